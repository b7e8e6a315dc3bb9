"""A slow, obviously-correct Compressive Transformer around a GPT-2 (Rae et al. 2020, Algorithm 1).

One row at a time, one slot at a time, plain Python lists: the memory of each layer is a
list of (key, value, holds_token) slots, the compression a real `torch.nn.functional.conv1d`
(or a Python mean/max over the slots of a group), the attention an explicit softmax. It
shares nothing with `memoria_ds.model.recurrent.compressive` except the model's weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _layer_norm(ln, x):
    return F.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, ln.eps)


def _attend(q, slots):
    """q (hd,), slots [(k, v)] -> sum softmax(q.k / sqrt(hd)) v."""
    scores = torch.stack([q @ k for k, _ in slots]) / math.sqrt(q.shape[0])
    weights = torch.softmax(scores, dim=0)
    return sum(w * v for w, (_, v) in zip(weights, slots))


class ReferenceCompressive:
    """Per row: `mem[layer]` and `cmem[layer]`, lists of (k (D,), v (D,), holds) slots."""

    def __init__(self, model, rows: int):
        cfg = model.config
        s = cfg.memory_settings
        self.model, self.cfg = model, cfg
        self.rate, self.how, self.weight = s["compression_rate"], s["compression"], s["reconstruction_weight"]
        self.M = s["memory_length"]
        self.C = s["compressed_length"]
        self.mem = [[[] for _ in range(cfg.n_layer)] for _ in range(rows)]
        self.cmem = [[[] for _ in range(cfg.n_layer)] for _ in range(rows)]
        self.segments = [0] * rows

    # ------------------------------------------------------------------ compression f_c
    def _compress(self, layer, group):
        """A group of `rate` slots -> one slot (Rae et al.: conv1d, kernel = stride = c; or pooling)."""
        holds = any(h for _, _, h in group)
        if not holds:
            D = group[0][0].shape[0]
            return torch.zeros(D), torch.zeros(D), False
        if self.how == "conv":
            out = []
            for which, nets in ((0, self.model.memory_net.keys), (1, self.model.memory_net.values)):
                lin = nets[layer].linear
                D = lin.weight.shape[0]
                conv_weight = lin.weight.view(D, self.rate, D).transpose(1, 2)  # (D_out, D_in, c)
                signal = torch.stack([slot[which] if slot[2] else torch.zeros(D) for slot in group], dim=1)
                out.append(F.conv1d(signal[None], conv_weight, lin.bias, stride=self.rate)[0, :, 0])
            return out[0], out[1], True
        kept = [slot for slot in group if slot[2]]
        if self.how == "mean":
            return sum(s[0] for s in kept) / len(kept), sum(s[1] for s in kept) / len(kept), True
        return torch.stack([s[0] for s in kept]).amax(0), torch.stack([s[1] for s in kept]).amax(0), True

    # ------------------------------------------------------------------ one segment of one row
    @torch.no_grad()
    def step(self, row: int, ids: torch.Tensor):
        """Logits (L, V) of the segment `ids` (L,), the reconstruction loss terms, and the memory update."""
        model, cfg = self.model, self.cfg
        tr = model.transformer
        H, D = cfg.n_head, cfg.n_embd
        hd = D // H
        L = ids.shape[0]
        bank = (self.segments[row] % 2) * (cfg.n_positions // 2) if cfg.xl_positions == "alternate" else 0
        h = tr.wte.weight[ids] + tr.wpe.weight[torch.arange(L) + bank]
        layer_errors = []
        for i, block in enumerate(tr.h):
            x = _layer_norm(block.ln_1, h)
            qkv = x @ block.attn.c_attn.weight + block.attn.c_attn.bias  # HF Conv1D: x W + b
            q, k, v = qkv.split(D, dim=1)
            memory = self.cmem[row][i] + self.mem[row][i]
            out = torch.zeros(L, D)
            for head in range(H):
                sl = slice(head * hd, (head + 1) * hd)
                for j in range(L):
                    slots = [(mk[sl], mv[sl]) for mk, mv, holds in memory if holds]
                    slots += [(k[t, sl], v[t, sl]) for t in range(j + 1)]
                    out[j, sl] = _attend(q[j, sl], slots)
            h = h + (out @ block.attn.c_proj.weight + block.attn.c_proj.bias)
            h = h + block.mlp(_layer_norm(block.ln_2, h))
            # memory update (Algorithm 1): mem <- last M of [mem, h]; old_mem -> f_c -> cmem
            full = self.mem[row][i] + [(k[t], v[t], True) for t in range(L)]
            kept, evicted = full[-self.M:], full[:-self.M] if len(full) > self.M else []
            kept = [(torch.zeros(D), torch.zeros(D), False)] * (self.M - len(kept)) + kept
            evicted = [(torch.zeros(D), torch.zeros(D), False)] * (-len(evicted) % self.rate) + evicted
            compressed = [self._compress(i, evicted[g:g + self.rate]) for g in range(0, len(evicted), self.rate)]
            layer_errors.append(self._reconstruction(q, evicted, compressed, H, hd))
            cmem = self.cmem[row][i] + compressed
            cmem = cmem[-self.C:]
            cmem = [(torch.zeros(D), torch.zeros(D), False)] * (self.C - len(cmem)) + cmem
            self.mem[row][i], self.cmem[row][i] = kept, [(a.detach(), b.detach(), c) for a, b, c in cmem]
        self.segments[row] += 1
        logits = _layer_norm(tr.ln_f, h) @ model.lm_head.weight.T
        return logits, layer_errors

    @staticmethod
    def _reconstruction(q, evicted, compressed, H, hd):
        """Sum over heads, queries and channels of (attn(q, old) - attn(q, f_c(old)))^2, and the element count."""
        old = [s for s in evicted if s[2]]
        new = [s for s in compressed if s[2]]
        if not old or not new:
            return None
        total = 0.0
        for head in range(H):
            sl = slice(head * hd, (head + 1) * hd)
            for j in range(q.shape[0]):
                a = _attend(q[j, sl], [(k[sl], v[sl]) for k, v, _ in old])
                b = _attend(q[j, sl], [(k[sl], v[sl]) for k, v, _ in new])
                total = total + ((a - b) ** 2).sum()
        return total, q.shape[0] * H * hd
