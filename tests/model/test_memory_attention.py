"""The memory cross-attention and the abstractor against slow, obviously-correct references."""

import math

import pytest
import torch

from memoria_ds.model.abstractor import Abstractor
from memoria_ds.model.memory_attention import MemoryAttention, MemoryInputs, contribution

B, L, N, R, D, H = 3, 5, 2, 4, 8, 2


def _module(mode):
    torch.manual_seed(0)
    m = MemoryAttention(D, H, D, mode, eps=1e-5, attn_dropout=0.0, resid_dropout=0.0).eval()
    with torch.no_grad():
        m.out_proj.weight.normal_(0, 0.3)
        m.out_proj.bias.normal_(0, 0.3)
        for ln in [x for x in m.modules() if isinstance(x, torch.nn.LayerNorm)]:
            ln.weight.normal_(1, 0.2)
            ln.bias.normal_(0, 0.2)
    return m


def _inputs():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, L, D, generator=gen)
    engrams = torch.randn(B, N + R, D, generator=gen)
    # row 0: WM and 3 of 4 reminded slots real; row 1: WM only; row 2: no memory at all
    mask = torch.tensor([[True, True, False, True], [False, False, False, False], [False, False, False, False]])
    wm_active = torch.tensor([True, True, False])
    query_mask = torch.tensor([[True] * L, [True] * L, [True, True, True, False, False]])
    return hidden, engrams, MemoryInputs(wm_active, mask, mask.any(1), query_mask, use_sdpa=False)


def _attend_slow(m, x, keys, allowed):
    """Per row, head and query: softmax over allowed keys. Returns output (D,) and probabilities."""
    hd = D // H
    q = m.q_proj(x).view(H, hd)
    kv = m.kv_proj(keys)
    k, v = kv[:, :D].reshape(-1, H, hd), kv[:, D:].reshape(-1, H, hd)
    out, probs = torch.zeros(H, hd), torch.zeros(H, keys.shape[0])
    for h in range(H):
        scores = torch.tensor(
            [float(q[h] @ k[j, h]) / math.sqrt(hd) if allowed[j] else -math.inf for j in range(keys.shape[0])]
        )
        p = torch.softmax(scores, 0)
        probs[h] = p
        out[h] = sum(p[j] * v[j, h] for j in range(keys.shape[0]) if allowed[j])
    return out.reshape(D), probs


@torch.no_grad()
def _reference(m, hidden, engrams, mem):
    out = hidden.clone()
    weights = torch.zeros(B, R)
    for b in range(B):
        wm, rem, allowed = engrams[b, :N], engrams[b, N:], mem.reminded_mask[b]
        rem_on = bool(allowed.any())
        per_query = []
        for t in range(L):
            h = hidden[b, t]
            if m.mode == "sequential":
                if mem.wm_active[b]:
                    h = h + m.out_proj(_attend_slow(m, m.ln_wm(h), wm, torch.ones(N, dtype=torch.bool))[0])
                if rem_on:
                    a, p = _attend_slow(m, m.ln_rem(h), rem, allowed)
                    h = h + m.out_proj(a)
                    per_query.append(p.mean(0))
            else:
                x = m.ln(h)
                a = torch.zeros(D)
                if mem.wm_active[b]:
                    a = a + _attend_slow(m, x, wm, torch.ones(N, dtype=torch.bool))[0]
                if rem_on:
                    a_rem, p = _attend_slow(m, x, rem, allowed)
                    a = a + a_rem
                    per_query.append(p.mean(0))
                if mem.wm_active[b] or rem_on:
                    h = h + m.out_proj(a)
            out[b, t] = h
        if per_query:
            q = mem.query_mask[b]
            weights[b] = torch.stack([w for w, keep in zip(per_query, q) if keep]).mean(0)
    return out, weights


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
@pytest.mark.parametrize("use_sdpa", [False, True])
def test_matches_the_slow_reference(mode, use_sdpa):
    m = _module(mode)
    hidden, engrams, mem = _inputs()
    mem.use_sdpa = use_sdpa
    with torch.no_grad():
        out, reminded = m(hidden, engrams, mem)
        weights = contribution([reminded], mem)
    ref_out, ref_weights = _reference(m, hidden, engrams, mem)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights[mem.reminded_active], ref_weights[mem.reminded_active], rtol=1e-5, atol=1e-6)
    assert (weights[mem.reminded_mask.logical_not() & mem.reminded_active[:, None]] == 0).all()  # padding gets none
    torch.testing.assert_close(weights[0].sum(), torch.tensor(1.0))  # a distribution over the real engrams
    torch.testing.assert_close(out[2], hidden[2], rtol=0, atol=0)  # gated row: exactly unchanged


def _reference_autograd(m, hidden, engrams, mem):
    """Differentiable and slow: per row, each use attends over only its own (allowed) engrams."""
    hd = D // H

    def attend(x, keys):
        q = m.q_proj(x).view(-1, H, hd).transpose(0, 1)  # (H, L, hd)
        k, v = m.kv_proj(keys).split(D, dim=-1)
        k, v = k.view(-1, H, hd).transpose(0, 1), v.view(-1, H, hd).transpose(0, 1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1)
        return (probs @ v).transpose(0, 1).reshape(-1, D)

    rows = []
    for b in range(B):
        h, wm, allowed = hidden[b], engrams[b, :N], mem.reminded_mask[b]
        rem, rem_on, wm_on = engrams[b, N:][allowed], bool(allowed.any()), bool(mem.wm_active[b])
        if m.mode == "sequential":
            if wm_on:
                h = h + m.out_proj(attend(m.ln_wm(h), wm))
            if rem_on:
                h = h + m.out_proj(attend(m.ln_rem(h), rem))
        elif wm_on or rem_on:
            x = m.ln(h)
            a = (attend(x, wm) if wm_on else 0) + (attend(x, rem) if rem_on else 0)
            h = h + m.out_proj(a)
        rows.append(h)
    return torch.stack(rows)


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
@pytest.mark.parametrize("use_sdpa", [False, True])
def test_gradients_match_the_per_row_reference(mode, use_sdpa):
    """The masked attention over all N + R engrams differentiates as attentions over each use's own engrams."""
    m = _module(mode).train()  # dropout 0: training mode changes nothing else
    hidden, engrams, mem = _inputs()
    mem.use_sdpa = use_sdpa
    cotangent = torch.randn(B, L, D, generator=torch.Generator().manual_seed(5))
    grads = []
    for run in (lambda h, e: m(h, e, mem)[0], lambda h, e: _reference_autograd(m, h, e, mem)):
        m.zero_grad()
        h, e = hidden.clone().requires_grad_(), engrams.clone().requires_grad_()
        (run(h, e) * cotangent).sum().backward()
        grads.append([h.grad, e.grad[:, :N]] + [p.grad.clone() for p in m.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_masks_built_once_per_forward_equal_a_block_s_own():
    hidden, engrams, mem = _inputs()
    once = MemoryInputs(mem.wm_active, mem.reminded_mask, mem.reminded_active, mem.query_mask, False, num_wm=N,
                        dtype=torch.float32)
    assert once.masks is not None and once.masks_for(N, torch.float32) is once.masks
    m = _module("sequential")
    with torch.no_grad():
        a, wa = m(hidden, engrams, once)
        b, wb = m(hidden, engrams, mem)  # built by the block
    assert torch.equal(a, b) and torch.equal(contribution([wa], once), contribution([wb], mem))
    assert once.masks.rem_keys[2].isneginf().sum() == N  # a row with no reminded engram: all R slots, no WM
    assert (once.masks.wm_keys[..., N:] == float("-inf")).all() and (once.masks.wm_keys[..., :N] == 0).all()


def test_contribution_is_taken_before_dropout():
    # parallel mode: the M_rem query does not pass through the (dropped-out) WM use first
    m = MemoryAttention(D, H, D, "parallel", eps=1e-5, attn_dropout=0.5, resid_dropout=0.0)
    hidden, engrams, mem = _inputs()
    m.train()
    torch.manual_seed(3)
    out_train, r_train = m(hidden, engrams, mem)
    m.eval()
    out_eval, r_eval = m(hidden, engrams, mem)
    w_train, w_eval = contribution([r_train], mem), contribution([r_eval], mem)
    torch.testing.assert_close(w_train, w_eval, rtol=0, atol=1e-7)
    assert (out_train - out_eval).abs().max() > 1e-3  # dropout did act on the output


@pytest.mark.parametrize("style", ["transformer", "authors"])
def test_abstractor_matches_its_formula(style):
    torch.manual_seed(0)
    a = Abstractor(D, N, 4 * D, "gelu_new", style=style).eval()
    with torch.no_grad():
        a.queries.normal_()
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 6, D, generator=gen)
    mask = torch.tensor([[True] * 4 + [False] * 2, [False] * 6])
    with torch.no_grad():
        got = a(hidden, mask)
        h = hidden[0, :4]
        scale = D**-0.5 if style == "transformer" else 1.0
        probs = torch.softmax(a.queries @ a.key(h).T * scale, dim=-1)
        pooled = probs @ a.value(h)
        inner = a.ffn_in(pooled)
        if style == "transformer":
            inner = torch.nn.functional.gelu(inner, approximate="tanh")
        expected = a.ffn_out(inner)
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got[1]).all()  # a row with no previous segment stays finite (and is gated later)


@pytest.mark.parametrize("use_sdpa", [False, True])
def test_the_contribution_of_several_blocks_is_the_mean_of_theirs(use_sdpa):
    """`contribution` computes every block's M_rem probabilities in one batched softmax: the mean over
    blocks of each block's own contribution (the paper's w_i, averaged over layers), with and without
    SDPA, and with blocks of different scales (GPT-2's `scale_attn_by_inverse_layer_idx`)."""
    hidden, engrams, mem = _inputs()
    mem.use_sdpa = use_sdpa
    reads = []
    with torch.no_grad():
        for seed in range(3):
            m = _module("sequential")
            gen = torch.Generator().manual_seed(seed)
            m.q_proj.weight.add_(0.5 * torch.randn(m.q_proj.weight.shape, generator=gen))  # three different blocks
            reads.append(m(hidden, engrams, mem)[1])
    each = torch.stack([contribution([r], mem) for r in reads])  # (3, B, R)
    assert (each[0] - each[1]).abs().max() > 1e-3
    torch.testing.assert_close(contribution(reads, mem), each.mean(0), rtol=1e-5, atol=1e-7)
    if use_sdpa:  # a scale per block
        for i, r in enumerate(reads):
            r.scale = r.scale / (i + 1)
        each = torch.stack([contribution([r], mem) for r in reads])
        torch.testing.assert_close(contribution(reads, mem), each.mean(0), rtol=1e-5, atol=1e-7)
