"""A slow, obviously-correct Memformer around a GPT-2 (Wu et al. 2020: memory reader, memory
writer with slot attention, biased memory normalisation), one row, one slot, one head at a time.

Independent of `memoria_ds.model.recurrent.memformer` except for the model's weights: the
memory is a Python list of k slot vectors per row; every attention is an explicit softmax over
a Python list of (key, value) pairs; the normalisation divides by a norm summed by hand.
"""

from __future__ import annotations

import math

import torch

from compressive_reference import _attend, _layer_norm


def _linear(lin, x):
    return x @ lin.weight.T + lin.bias


def _unit(v):
    return v / math.sqrt(sum(float(c) ** 2 for c in v))


class ReferenceMemformer:
    """Per row: `slots[row]`, a list of k (D,) vectors, or None for a fresh row (the initial slots)."""

    def __init__(self, model, rows: int):
        self.model, self.cfg, self.net = model, model.config, model.memory_net
        self.tau = model.config.memory_settings["temperature"]
        self.slots = [None] * rows

    def initial(self):
        """m_0^i = v_i / ||v_i||."""
        return [_unit(v) for v in self.net.slot_bias.weight]

    def reset(self, row):
        self.slots[row] = None

    def _read(self, layer, hidden, memory):
        """(L, D) output of block `layer`'s memory reader: LN, then per head softmax over the k slots."""
        net, H = self.net, self.cfg.n_head
        D = hidden.shape[1]
        hd = D // H
        x = _layer_norm(net.read_norm[layer], hidden)
        q = _linear(net.read_query[layer], x)
        kv = [_linear(net.read_key_value[layer], m) for m in memory]
        out = torch.zeros(hidden.shape[0], D)
        for head in range(H):
            sl = slice(head * hd, (head + 1) * hd)
            pairs = [(t[:D][sl], t[D:][sl]) for t in kv]
            for j in range(hidden.shape[0]):
                out[j, sl] = _attend(q[j, sl], pairs)
        return _linear(net.read_out[layer], out)

    def _write(self, memory, hidden):
        """The next slots: slot i attends over [itself; the tokens] (temperature tau), then m + v_i, normalised."""
        net, H = self.net, self.cfg.n_head
        D = hidden.shape[1]
        hd = D // H
        tokens_k = [_linear(net.write_key, h) for h in hidden]
        tokens_v = [_linear(net.write_value, h) for h in hidden]
        new = []
        for i, m in enumerate(memory):
            q, own_k = _linear(net.write_query, m), _linear(net.write_key, m)
            slot = torch.zeros(D)
            for head in range(H):
                sl = slice(head * hd, (head + 1) * hd)
                keys = [own_k[sl]] + [k[sl] for k in tokens_k]
                values = [m[sl]] + [v[sl] for v in tokens_v]  # the slot's own value is itself
                scores = [float(q[sl] @ k) / (math.sqrt(hd) * self.tau) for k in keys]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                slot[sl] = sum((w / total) * v for w, v in zip(weights, values))
            new.append(_unit(slot + net.slot_bias.weight[i]))
        return new

    @torch.no_grad()
    def step(self, row: int, ids: torch.Tensor) -> torch.Tensor:
        """Logits (L, V) of the segment `ids` (L,) of `row`, and the row's memory update."""
        model, cfg = self.model, self.cfg
        tr = model.transformer
        H, D = cfg.n_head, cfg.n_embd
        hd = D // H
        L = ids.shape[0]
        memory = self.slots[row] if self.slots[row] is not None else self.initial()
        h = tr.wte.weight[ids] + tr.wpe.weight[torch.arange(L)]
        for i, block in enumerate(tr.h):
            x = _layer_norm(block.ln_1, h)
            qkv = x @ block.attn.c_attn.weight + block.attn.c_attn.bias
            q, k, v = qkv.split(D, dim=1)
            out = torch.zeros(L, D)
            for head in range(H):
                sl = slice(head * hd, (head + 1) * hd)
                for j in range(L):
                    out[j, sl] = _attend(q[j, sl], [(k[t, sl], v[t, sl]) for t in range(j + 1)])
            attn = out @ block.attn.c_proj.weight + block.attn.c_proj.bias
            h = h + attn + self._read(i, h, memory)  # the reader beside the self-attention
            h = h + block.mlp(_layer_norm(block.ln_2, h))
        final = _layer_norm(tr.ln_f, h)
        self.slots[row] = self._write(memory, final)
        return final @ model.lm_head.weight.T
