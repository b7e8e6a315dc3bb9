"""MemSizer's attention (Zhang & Cai 2022, "Linearizing Transformers with Key-Value Memory").

Each layer keeps a key-value memory of k slots. Token t writes the outer product of its key
and value into it, and reads it through a distribution over the slots:

    k_t = LN(W_k x_t)                          (k,)  one key per slot
    v_t = LN(W_v x_t)                          (D,)
    S_t = S_{t-1} + k_t v_t^T                  (k, D), S_0 = 0
    phi_t = mean_h softmax(Phi_h x_t)          (k,)  each head's distribution over the slots, averaged
    y_t = phi_t S_t / sqrt(t)                  (D,)  t: tokens read so far, t itself included

(jcyk/memsizer, `src/attention.py`, `CausalAttention.incremental_revatt`: the recurrent form, one
token at a time). Over a segment the same outputs come from the causal form

    y_i = (sum_{j <= i} (phi_i . k_j) v_j + phi_i S_0) / sqrt(t_0 + i + 1)

one (L, L) lower-triangular matmul (`memsizer_read`), where S_0 and t_0 are what earlier
segments left (zero for a fresh stream). The reference's `masked_revatt` computes the same sum
as a (L, L, k, D) tensor of prefix memories; the (L, L) scores are the same arithmetic in
another order, O(L^2 (k + D)) instead of O(L^2 k D). No output projection: the value
projection is D x D and the output goes straight to the residual, as the reference's.

Notation: B rows, L tokens, D width, H query heads, K slots.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from .config import MemSizerConfig


def memsizer_read(phi: Tensor, keys: Tensor, values: Tensor, scale: Tensor,
                  start: Tensor | None = None) -> Tensor:
    """y_i = (sum_{j <= i} (phi_i . k_j) v_j + phi_i S_0) * scale_i.

    Args:
        phi: (B, L, K) each position's distribution over the slots.
        keys: (B, L, K) the keys (zero at positions that are not stored: padding).
        values: (B, L, D).
        scale: (B, L, 1) 1 / sqrt(t_i), t_i the tokens read up to i (those of earlier segments included).
        start: (B, K, D) S_0, the memory before this segment, or None (empty).

    Returns:
        (B, L, D).
    """
    scores = (phi @ keys.transpose(1, 2)).tril()  # (B, L, L): position i reads positions j <= i
    y = scores @ values  # (B, L, D)
    if start is not None:
        y = y + phi @ start.to(phi.dtype)
    return y * scale


def memory_after(keys: Tensor, values: Tensor, start: Tensor) -> Tensor:
    """S_0 + sum_j k_j v_j^T in the memory's dtype (fp32; fp64 for a float64 model), detached (what the
    next segment reads; no gradient crosses segments, as Transformer-XL's cache).
    keys (B, L, K), values (B, L, D), start (B, K, D) -> (B, K, D)."""
    return start + keys.detach().to(start.dtype).transpose(1, 2) @ values.detach().to(start.dtype)


def sinusoids(positions: Tensor, dim: int) -> Tensor:
    """fairseq's sinusoidal position embeddings (`SinusoidalPositionalEmbedding.get_embedding`, the
    reference's) at `positions`, computed in float64 (a stream's positions grow without bound).

    Args:
        positions: (B, L) int64.
        dim: D (>= 4); an odd D gets a zero last column, as fairseq's.

    Returns:
        (B, L, D) float64: [sin(p f_0), ..., sin(p f_{h-1}), cos(p f_0), ...], f_j = 10000^(-j / (h - 1)), h = D // 2.
    """
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float64, device=positions.device)
                     * -(math.log(10000) / (half - 1)))  # (h,)
    angle = positions.to(torch.float64)[..., None] * freq  # (B, L, h)
    out = torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)
    if dim % 2:
        out = torch.nn.functional.pad(out, (0, 1))
    return out


class SlotProjection(Conv1D):
    """Phi, W_k and W_v as one GPT-2 Conv1D ((D, H*K + K + D), (in, out)): one matmul, and the name
    (`c_attn`) LoRA targets. Its own class: initialised part by part (`MemSizerLMHeadModel._init_weights`)."""


class MemSizerAttention(nn.Module):
    """One layer's MemSizer attention (replaces a GPT-2 block's self-attention).

    Parameters: `c_attn` (a `SlotProjection`: Phi, W_k, W_v, outputs H*K + K + D), `k_norm` (K), `v_norm` (D).
    """

    def __init__(self, config: MemSizerConfig) -> None:
        super().__init__()
        self.heads, self.slots, self.width = config.n_head, config.memsizer_slots, config.n_embd
        self.c_attn = SlotProjection(config.query_width + config.memsizer_slots + config.n_embd, config.n_embd)
        self.k_norm = nn.LayerNorm(config.memsizer_slots, eps=config.layer_norm_epsilon)
        self.v_norm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def project(self, x: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(B, L, D) -> phi (B, L, K), keys (B, L, K) (zero where `keep` (B, L, 1) is 0), values (B, L, D)."""
        B, L, _ = x.shape
        q, k, v = self.c_attn(x).split([self.heads * self.slots, self.slots, self.width], dim=-1)
        # each head's distribution over the slots (dropout on it, as the reference), averaged over the heads
        phi = self.attn_dropout(q.view(B, L, self.heads, self.slots).softmax(dim=-1)).mean(dim=2)  # (B, L, K)
        k = self.k_norm(k)
        if keep is not None:
            k = k * keep  # a padded position is neither read nor stored
        return phi, k, self.v_norm(v)

    def forward(self, x: Tensor, scale: Tensor, keep: Tensor | None = None,
                start: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(B, L, D) -> (B, L, D), and with `start` the memory after this segment.

        Args:
            scale: (B, L, 1) 1 / sqrt(t_i).
            keep: (B, L, 1) 1 at real tokens, 0 at padding; None: every token is real.
            start: (B, K, D) the memory carried from earlier segments (fp32), or None (nothing carried).

        Returns:
            (output after dropout, the memory S_0 + sum_j k_j v_j^T (B, K, D) detached, or None).
        """
        phi, k, v = self.project(x, keep)
        y = memsizer_read(phi, k, v, scale, start)
        return self.resid_dropout(y), None if start is None else memory_after(k, v, start)


__all__ = ["MemSizerAttention", "SlotProjection", "memsizer_read", "memory_after", "sinusoids"]
