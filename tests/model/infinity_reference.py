"""A slow, obviously-correct infinity-former around a GPT-2 (Martins et al. 2022, as the
authors' `infinity_gpt2` runs it), one row and one layer at a time.

Independent of `memoria_ds.model.recurrent.infinity` / `continuous` except for the model's
weights: the ridge regression is solved as the normal equations with the memory placed at
its points of [0, 1] and zeros at the padding points outside it; the continuous attention's
expectation E[psi(t)] is integrated numerically on a fine grid; the mask network is
`F.conv1d`. Even samples only (sticky memories draw at random).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from compressive_reference import _attend, _layer_norm


def _gauss(t, mu, sigma):
    return torch.exp(-0.5 * ((t - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))


def _basis(n):
    centres = [k / (n // 2 - 1) for k in range(n // 2)]
    mu = torch.tensor([c for c in centres for _ in (0.005, 0.01)], dtype=torch.float64)
    sigma = torch.tensor([s for _ in centres for s in (0.005, 0.01)], dtype=torch.float64)
    return mu, sigma


def _grid(first, last, count):
    return [first + k * (last - first) / (count - 1) for k in range(count)]


def _points(length, samples=0, tau=None):
    """(all regression points, index of the first inner point): padding, then the memory's points, then padding."""
    if samples == 0:
        if length % 2:
            pts = _grid(-0.5 + 1 / length, 1.5 - 1 / length, 2 * length - 1)
        else:
            pts = _grid(-0.5 + 1 / (2 * length), 1.5 - 1 / (2 * length), 2 * length)
        cut = (length - 1) // 2 if length % 2 else length // 2
        return pts, cut  # the inner `length` points are pts[cut:cut + length]
    inner = [tau * (k + 1) / samples for k in range(samples)] + [tau + (1 - tau) * (k + 1) / length
                                                                    for k in range(length)]
    total = length + samples
    shift = 1 / (2 * length + samples)
    pad = _grid(-0.5 + shift, 1.5 - shift, 2 * total)
    before, after = [p for p in pad if p < 0], [p for p in pad if p > 1]
    return before + inner + after, len(before)


def ridge_fit(vectors, n, samples=0, tau=None):
    """(P, D) memory vectors -> (N, D) coefficients: min ||F^T B - X||^2 + 0.5 ||B||^2 with X = 0 at the padding."""
    points, first = _points(vectors.shape[0] - samples, samples, tau)
    mu, sigma = _basis(n)
    Fm = _gauss(torch.tensor(points, dtype=torch.float64)[None, :], mu[:, None], sigma[:, None])  # (N, P)
    X = torch.zeros(len(points), vectors.shape[1], dtype=torch.float64)
    X[first:first + vectors.shape[0]] = vectors.double()
    return torch.linalg.solve(Fm @ Fm.T + 0.5 * torch.eye(n, dtype=torch.float64), Fm @ X)


def expectation(mu_q, var_q, n):
    """E_{N(mu_q, var_q)}[psi(t)], integrated on a fine grid (N,)."""
    t = torch.linspace(-2.0, 3.0, 400001, dtype=torch.float64)
    density = _gauss(t, mu_q, math.sqrt(var_q))
    mu, sigma = _basis(n)
    return torch.trapezoid(density[None, :] * _gauss(t[None, :], mu[:, None], sigma[:, None]), t, dim=1)


class ReferenceInfinity:
    def __init__(self, model, rows: int):
        cfg = model.config
        self.model, self.cfg, self.net = model, cfg, model.memory_net
        s = cfg.memory_settings
        self.tau, self.mu_0, self.sigma_0 = s["tau"], s["mu_0"], s["sigma_0"]
        self.n, self.samples = self.net.num_basis, self.net.num_samples
        self.prev = [[None] * cfg.n_layer for _ in range(rows)]  # (P, D) block inputs
        self.coef = [[None] * cfg.n_layer for _ in range(rows)]  # (N, D) float64

    def _long_term(self, row, layer, q):
        """(L, D) output of the long-term attention for the (L, D) queries, and the mean KL."""
        net, H = self.net, self.cfg.n_head
        x = self.prev[row][layer].double()  # (P, D)
        conv = net.mask[layer]
        gate = torch.sigmoid(F.conv1d(x.T[None], conv.weight.double(), conv.bias.double(), padding=1)[0].T)
        keys = x * gate
        if self.coef[row][layer] is None:
            coef = ridge_fit(keys, self.n)
        else:
            positions = torch.tensor([self.tau * (k + 1) / self.samples / self.tau for k in range(self.samples)],
                                     dtype=torch.float64)
            mu, sigma = _basis(self.n)
            old = _gauss(positions[:, None], mu[None, :], sigma[None, :]) @ self.coef[row][layer]  # (S, D)
            coef = ridge_fit(torch.cat([old, keys]), self.n, self.samples, self.tau)
        self.coef[row][layer] = coef
        K = coef @ net.key[layer].weight.double().T  # (N, D)
        V = coef @ net.value[layer].weight.double().T
        D = K.shape[1]
        hd = D // H
        out = torch.zeros(q.shape[0], D, dtype=torch.float64)
        kls = []
        for h in range(H):
            sl = slice(h * hd, (h + 1) * hd)
            for j in range(q.shape[0]):
                scores = K[:, sl] @ q[j, sl].double() / math.sqrt(hd)  # (N,)
                mu_q = torch.sigmoid(scores @ net.mu[layer].weight.double()[0])
                var_q = max(F.softplus(scores @ net.sigma[layer].weight.double()[0]).item(), 1e-4)
                out[j, sl] = expectation(mu_q, var_q, self.n) @ V[:, sl]
                v0 = self.sigma_0**2
                kls.append(0.5 * (var_q / v0 - math.log(var_q / v0) - 1 + (mu_q.item() - self.mu_0) ** 2 / v0))
        return out @ net.out[layer].weight.double().T, sum(kls) / len(kls)

    @torch.no_grad()
    def step(self, row, ids):
        """Logits (L, V) of one row's segment and its mean KL over layers (None without a memory)."""
        model, cfg = self.model, self.cfg
        tr = model.transformer
        D = cfg.n_embd
        L = ids.shape[0]
        h = tr.wte.weight[ids] + tr.wpe.weight[torch.arange(L)]
        kls = []
        for i, block in enumerate(tr.h):
            block_input = h
            x = _layer_norm(block.ln_1, h)
            qkv = x @ block.attn.c_attn.weight + block.attn.c_attn.bias
            q, k, v = qkv.split(D, dim=1)
            H, hd = cfg.n_head, D // cfg.n_head
            out = torch.zeros(L, D)
            for head in range(H):
                sl = slice(head * hd, (head + 1) * hd)
                for j in range(L):
                    out[j, sl] = _attend(q[j, sl], [(k[t, sl], v[t, sl]) for t in range(j + 1)])
            attn = out @ block.attn.c_proj.weight + block.attn.c_proj.bias
            if self.prev[row][i] is not None:
                extra, kl = self._long_term(row, i, q)
                attn = attn + extra.float()
                kls.append(kl)
            self.prev[row][i] = block_input.detach()
            h = h + attn
            h = h + block.mlp(_layer_norm(block.ln_2, h))
        logits = _layer_norm(tr.ln_f, h) @ model.lm_head.weight.T
        return logits, (sum(kls) / len(kls) if kls else None)
