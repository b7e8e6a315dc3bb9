"""The Memory Mosaic's memory units (Zhang et al. 2024, Sections 2 and 5; equations 3, 7, 8).

A memory unit is an associative memory read by Gaussian kernel smoothing (softmax attention
with unit scale) over keys and values made by trainable feature extractors:

    key    k_T = a_phi * Norm(kbar_T),  kbar_T = W_phi x_T + lambda_phi * kbar_{T-1}   (leaky average)
    value  v_T = a_psi * Norm(vbar_T),  vbar_T = c W_psi x_T + (1 - c) W_psi x_{T+1}   (peeks one step ahead)

(the paper writes vbar_T = vtilde_T + lambda_psi vtilde_{T+1}: the same direction, so after the
normalisation the same value, with lambda_psi = (1 - c) / c).

- The contextual memory stores this segment's pairs as it goes: position T reads the pairs
  (k_t, v_t) with t < T (v_t needs x_{t+1}, so t = T is not yet known): the mask excludes the
  diagonal (eq. 8 with delta = 1), and position 0 reads nothing (its output is 0).
- The persistent memory's keys come from the same kind of extractor; its keys/values are
  trained parameters (Sukhbaatar et al., 2019), read without a mask.

Parametrisation as in the reference (`nanoMosaics/mosaic_model.py`): each head's leak rate
is lambda = exp(-10 |p_leak|), its key scale a_phi = exp(min(10 p_key * s, log 65535)) (s = 1
for the contextual memory; 2 for the persistent memory, whose stored keys carry no scale of
their own), value and output scales exp(10 p). Each layer ends with an output projection
(`out_proj`) and dropout.

Notation: B rows, L tokens, D width, H heads, hd = D / H, S persistent slots, P persistent memories.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import EXP_SCALING, KEY_SCALE_MAX, NORM_EPS, MemoryMosaicConfig


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B, L, D) -> (B, H, L, hd)."""
    B, L, D = x.shape
    return x.view(B, L, heads, D // heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, L, hd) -> (B, L, D)."""
    B, H, L, hd = x.shape
    return x.transpose(1, 2).reshape(B, L, H * hd)


def leaky_average(k: Tensor, rate: Tensor, start: Tensor | None = None) -> Tensor:
    """kbar_T = sum_{t <= T} exp(-rate (T - t)) k_t (+ exp(-rate (T + 1)) start), every head at its own rate.

    Args:
        k: (B, H, L, hd).
        rate: (H,) non-negative; lambda = exp(-rate) is the leak coefficient.
        start: (B, H, hd) kbar of the position before this segment (a carried memory), or None.

    Returns:
        (B, H, L, hd), as one (L, L) lower-triangular matmul per head (as the reference does;
        a scan would do the same with L steps).
    """
    L = k.shape[-2]
    pos = torch.arange(L, device=k.device)
    # (L, L): t - T on and below the diagonal, 0 above it (as the reference's buffer): exp(rate * (t - T))
    # above the diagonal would overflow to inf, and its masked-out gradient 0 * inf would be NaN
    lag = (pos[None, :] - pos[:, None]).clamp(max=0).to(k.dtype)
    rate = rate.to(k.dtype)
    coef = torch.exp(lag * rate.view(-1, 1, 1)).tril()  # (H, L, L)
    out = coef @ k  # (B, H, L, hd)
    if start is not None:
        decay = torch.exp(-rate.view(-1, 1) * (pos + 1).to(k.dtype))  # (H, L): lambda^(T + 1)
        out = out + decay[None, :, :, None] * start.to(k.dtype)[:, :, None, :]
    return out


def normalise(x: Tensor) -> Tensor:
    """x / (|x| + eps) along the last dimension."""
    return x / (x.norm(dim=-1, keepdim=True) + NORM_EPS)


def peek_ahead(v: Tensor, mix: Tensor) -> Tensor:
    """c v_T + (1 - c) v_{T+1} per head (v_{L} = 0: the last position's value is never read in-segment).

    Args:
        v: (B, H, L, hd). mix: (H,) the weight c of the current position (unconstrained, as in the reference).
    """
    nxt = F.pad(v[:, :, 1:], (0, 0, 0, 1))  # (B, H, L, hd): position T holds v_{T+1}
    c = mix.to(v.dtype).view(1, -1, 1, 1)
    return (1 - c) * nxt + c * v


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, eager: bool) -> Tensor:
    """softmax(q k^T) v (unit scale: the keys carry their own), masked where `mask` is False.

    `eager` spells the softmax out (FLOP counters see it; SDPA's CPU kernel they do not).
    Shapes: q (B, H, Lq, hd), k and v (B or 1, H, Lk, hd), mask broadcastable to (B, H, Lq, Lk).
    """
    if not eager:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=1.0)
    att = q @ k.transpose(-1, -2)  # (B, H, Lq, Lk)
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf"))
    att = F.dropout(torch.softmax(att, dim=-1), dropout_p) if dropout_p else torch.softmax(att, dim=-1)
    return att @ v


def attend_causal(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, eager: bool) -> Tensor:
    """`attend` with query i reading keys j <= i (q, k, v of one length): SDPA's `is_causal`,
    which takes the flash kernel on a GPU (no mask in memory; its backward repeated bit for bit
    on an H200, where the masked kernel's does not)."""
    if not eager:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=1.0)
    L = q.shape[-2]
    return attend(q, k, v, torch.ones(L, L, dtype=torch.bool, device=q.device).tril(), dropout_p, eager)


def readable(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(mask, empty): queries with no key to read get their first key unmasked (so the softmax
    stays finite, forward and backward); `empty` (..., Lq, 1) marks them, to zero their output."""
    empty = ~mask.any(-1, keepdim=True)
    first = torch.zeros_like(mask)
    first[..., 0] = True
    return mask | (empty & first), empty


def contextual_mask(L: int, device: torch.device) -> Tensor:
    """(L - 1, L) bool: query T (1..L-1) reads key t iff t < T."""
    return torch.ones(L, L, dtype=torch.bool, device=device).tril(diagonal=-1)[1:]


class OutProj(nn.Linear):
    """A memory layer's output projection (its own class: initialised at 0.02 / sqrt(2 n_layer))."""


class KeyExtractor(nn.Module):
    """k_T = a_phi Norm(leaky average of W_phi x): per-head leak rate and key scale.

    Parameters: `proj` (W_phi), `leak` (H,) (rate = 10 |leak|), `scale` (H,) (a_phi = exp(10 scale * s)).
    """

    def __init__(self, config: MemoryMosaicConfig) -> None:
        super().__init__()
        self.heads = config.n_head
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.leak = nn.Parameter(torch.empty(config.n_head))
        self.scale = nn.Parameter(torch.empty(config.n_head))

    def forward(self, x: Tensor, scale_power: float = 1.0, start: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(B, L, D) -> keys (B, H, L, hd), and the last position's kbar (B, H, hd) (for a carried memory).

        Args:
            start: (B, H, hd) kbar before this segment (`leaky_average`), or None.
        """
        kbar = leaky_average(split_heads(self.proj(x), self.heads), self.leak.abs() * EXP_SCALING, start)
        log_scale = (scale_power * EXP_SCALING * self.scale).clamp(max=KEY_SCALE_MAX)  # (H,)
        return normalise(kbar) * log_scale.exp().to(kbar.dtype).view(1, -1, 1, 1), kbar[:, :, -1]



class ValueExtractor(nn.Module):
    """v_T = a_psi Norm(c W_psi x_T + (1 - c) W_psi x_{T+1}).

    Parameters: `proj` (W_psi), `mix` (H,) (c), `scale` (H,) (a_psi = exp(10 scale)).
    """

    def __init__(self, config: MemoryMosaicConfig) -> None:
        super().__init__()
        self.heads = config.n_head
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.mix = nn.Parameter(torch.empty(config.n_head))
        self.scale = nn.Parameter(torch.empty(config.n_head))

    def forward(self, x: Tensor) -> Tensor:
        """(B, L, D) -> values (B, H, L, hd)."""
        return self.finish(peek_ahead(self.raw(x), self.mix))

    def raw(self, x: Tensor) -> Tensor:
        """(B, L, D) -> W_psi x per head (B, H, L, hd)."""
        return split_heads(self.proj(x), self.heads)

    def finish(self, vbar: Tensor) -> Tensor:
        """a_psi Norm(vbar), vbar (B, H, ..., hd)."""
        scale = (EXP_SCALING * self.scale).exp().to(vbar.dtype)
        return normalise(vbar) * scale.view(1, -1, *([1] * (vbar.dim() - 2)))

    def pending(self, last_raw: Tensor, first_raw: Tensor) -> Tensor:
        """The value of the previous segment's last position, now that its next token is known:
        a_psi Norm(c W x_{-1} + (1 - c) W x_0), from (B, H, hd) raw projections."""
        c = self.mix.to(last_raw.dtype).view(1, -1, 1)
        return self.finish(c * last_raw + (1 - c) * first_raw)


class ContextualMemory(nn.Module):
    """N_c = n_head contextual memory units (the block's first layer; replaces self-attention)."""

    def __init__(self, config: MemoryMosaicConfig) -> None:
        super().__init__()
        self.key = KeyExtractor(config)
        self.value = ValueExtractor(config)
        self.out_proj = OutProj(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = config.attn_pdrop
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: Tensor, key_padding: Tensor | None = None, eager: bool = False) -> Tensor:
        """(B, L, D) -> (B, L, D), the segment read alone (the reference's computation).

        Args:
            key_padding: (B, L) bool, True at real tokens; padded positions are never read.
            eager: the attention spelled out (`attend`).
        """
        k, _ = self.key(x)
        v = self.value(x)  # (B, H, L, hd) each
        B, H, L, hd = v.shape
        if L < 2:
            return self.resid_dropout(self.out_proj(torch.zeros_like(x)))
        dropout = self.attn_dropout if self.training else 0.0
        if key_padding is None:  # query T reads keys t <= T - 1: causal over (k[1:], k[:-1]), SDPA's flash kernel
            y = attend_causal(k[:, :, 1:], k[:, :, :-1], v[:, :, :-1], dropout, eager)  # (B, H, L-1, hd)
        else:
            mask, empty = readable(contextual_mask(L, x.device)[None, None] & key_padding[:, None, None, :])
            y = attend(k[:, :, 1:], k, v, mask, dropout, eager)  # (B, H, L-1, hd); mask (B, 1, L-1, L)
            y = y.masked_fill(empty, 0.0)  # a query with nothing to read (all its past padded) reads 0
        y = torch.cat([y.new_zeros(B, H, 1, hd), y], dim=2)  # position 0 reads nothing
        return self.resid_dropout(self.out_proj(merge_heads(y)))

    def forward_carried(self, x: Tensor, carry: Any, key_padding: Tensor | None = None,
                        eager: bool = False) -> tuple[Tensor, Any]:
        """(B, L, D) -> (B, L, D) reading also the pairs carried from earlier segments, and what to carry on.

        `carry` is a `recurrent.mosaic.ContextCarry` (the carried memory's view of this block);
        the new one is of its type. Position T reads the carried pairs (`carry.keys/values`
        where `carry.mask`), the pair of the previous segment's last position (its value
        completed by this segment's first token, where `carry.has_last`), and this segment's
        pairs t < T. Padded positions (`key_padding`) are neither read nor stored; the
        leaky averages run through them (streams pad only at their very end).

        Returns:
            (output, the new carry before rolling: its slots are the carried, the pending and
            this segment's complete pairs; the last position's key, raw value and kbar). The
            memory kind keeps the last M slots.
        """
        k, kbar = self.key(x, start=carry.kbar)  # a fresh or reset row's kbar is 0: no contribution
        raw = self.value.raw(x)  # (B, H, L, hd)
        v = self.value.finish(peek_ahead(raw, self.value.mix))
        B, H, L, hd = v.shape
        valid = key_padding if key_padding is not None else torch.ones(B, L, dtype=torch.bool, device=x.device)
        pending_v = self.value.pending(carry.last_raw.to(raw.dtype), raw[:, :, 0])  # (B, H, hd)
        has_pending = carry.has_last & valid[:, 0]
        slot_k = torch.cat([carry.keys.to(k.dtype), carry.last_key.to(k.dtype)[:, :, None]], 2)  # (B, H, M+1, hd)
        slot_v = torch.cat([carry.values.to(v.dtype), pending_v[:, :, None]], 2)
        slot_mask = torch.cat([carry.mask, has_pending[:, None]], 1)  # (B, M+1)
        seg_mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(-1)[None] & valid[:, None, :]  # (B, L, L)
        mask = torch.cat([slot_mask[:, None, :].expand(B, L, -1), seg_mask], 2)[:, None]  # (B, 1, L, M+1+L)
        mask, empty = readable(mask)
        y = attend(k, torch.cat([slot_k, k], 2), torch.cat([slot_v, v], 2), mask,
                   self.attn_dropout if self.training else 0.0, eager).masked_fill(empty, 0.0)  # (B, H, L, hd)
        # this segment's complete pairs: t < L - 1 whose token t and next token t + 1 are real
        pair_mask = valid[:, :-1] & valid[:, 1:]
        new = dataclasses.replace(
            carry, keys=torch.cat([slot_k, k[:, :, :-1]], 2).detach(),
            values=torch.cat([slot_v, v[:, :, :-1]], 2).detach(), mask=torch.cat([slot_mask, pair_mask], 1),
            last_key=k[:, :, -1].detach(), last_raw=raw[:, :, -1].detach(), kbar=kbar.detach(),
            has_last=valid[:, -1])
        return self.resid_dropout(self.out_proj(merge_heads(y))), new


class PersistentMemory(nn.Module):
    """N_p = n_head persistent memory units (the block's second layer; replaces the FFN).

    Parameters: `key` (an extractor), `keys` / `values` (P, H, S, hd) the stored pairs,
    `scale` (H,) (the output scale exp(10 scale)), `out_proj`.
    """

    def __init__(self, config: MemoryMosaicConfig) -> None:
        super().__init__()
        shape = (config.pmem_count, config.n_head, config.pmem_size, config.head_dim)
        self.key = KeyExtractor(config)
        self.keys = nn.Parameter(torch.empty(shape))
        self.values = nn.Parameter(torch.empty(shape))
        self.scale = nn.Parameter(torch.empty(config.n_head))
        self.out_proj = OutProj(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = config.attn_pdrop
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: Tensor, eager: bool = False, start: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(B, L, D) -> (B, L, D), and the last position's kbar (B, H, hd).

        Args:
            eager: the attention spelled out (`attend`).
            start: (B, H, hd) the key's leaky average before this segment (a carried memory), or None.
        """
        k, kbar = self.key(x, scale_power=2.0, start=start)  # (B, H, L, hd): squared scale (stored keys have none)
        p = self.keys.shape[0]
        dropout = self.attn_dropout if self.training else 0.0
        B = k.shape[0]  # the stored pairs expanded to the batch (no copy): with a batch of 1 against
        # the queries' B, CUDA's SDPA takes its math kernel (10x the time, the (B, H, L, S) weights kept)
        y = sum(attend(k, self.keys[i].expand(B, -1, -1, -1), self.values[i].expand(B, -1, -1, -1), None, dropout,
                       eager) for i in range(p)) / p
        # y: (B, H, L, hd)
        y = y * (EXP_SCALING * self.scale).exp().to(y.dtype).view(1, -1, 1, 1)
        return self.resid_dropout(self.out_proj(merge_heads(y))), kbar


__all__ = ["OutProj", "readable", "ContextualMemory", "PersistentMemory", "KeyExtractor", "ValueExtractor",
           "leaky_average", "peek_ahead", "normalise", "attend", "attend_causal", "contextual_mask", "split_heads",
           "merge_heads"]
