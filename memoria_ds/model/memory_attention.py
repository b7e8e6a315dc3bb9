"""Memory cross-attention: one module, two uses (WM, then the reminded engrams M_rem).

SPEC section 2 / paper Figure 10: after a block's self-attention, the tokens attend to
the working memory and, with the *same* attention weights, to the reminded engrams; each
use adds its own residual. The attention probabilities of the M_rem use (before dropout)
are each reminded engram's contribution `w_i` (SPEC step 8): their mean over heads and
query tokens is returned per block, and the model averages it over blocks.

Notation: B rows, L query tokens, N = N_wm engrams, R reminded slots (M_rem, padded),
D model width, H heads, E = H * hd the attention's inner width.

Rows without memory (the first segment after a reset) and rows with no reminded engram
are gated out with `torch.where`, which gives an exact zero (never 0 * garbage): such a
row computes exactly what the plain backbone computes. Shapes never depend on the data,
so the same modules run in every step (ZeRO-3's module trace and CUDA graphs stay valid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class MemoryInputs:
    """What every block's memory attention reads in one forward (built once per forward).

    Attributes:
        wm_active: (B,) bool, rows that have a working memory (a previous segment).
        reminded_mask: (B, R) bool, real reminded engrams of active rows.
        reminded_active: (B,) bool, rows with at least one reminded engram.
        query_mask: (B, L) bool, query tokens that count in the contribution mean
            (None: all of them).
        use_sdpa: run the WM use through `F.scaled_dot_product_attention`.
    """

    wm_active: Tensor
    reminded_mask: Tensor
    reminded_active: Tensor
    query_mask: Tensor | None
    use_sdpa: bool


class OutputProjection(nn.Linear):
    """The memory attention's output projection (its own type so that the model's init finds it).

    Zero-initialised by default (`memory_init="noop"`): the memory's output is then exactly 0.
    """


class MemoryAttention(nn.Module):
    """Cross-attention from the tokens to the engrams, used for WM and for M_rem.

    Args:
        dim: D, the backbone's hidden size (tokens and engrams).
        num_heads: H.
        inner_dim: E, width of q/k/v (D / 8 by default; D in the authors' code).
        mode: `"sequential"`: LN_wm -> attend WM -> residual -> LN_rem -> attend M_rem ->
            residual (the authors' block). `"parallel"`: one LN and one query serve both
            uses; the two attention outputs are summed before one output projection.
        eps: layer-norm epsilon (the backbone's).
        attn_dropout: dropout on attention probabilities. resid_dropout: on the output.
    """

    def __init__(
        self, dim: int, num_heads: int, inner_dim: int, mode: str, eps: float, attn_dropout: float, resid_dropout: float
    ) -> None:
        super().__init__()
        if inner_dim % num_heads:
            raise ValueError(f"memory attention width {inner_dim} is not a multiple of its {num_heads} heads")
        self.mode = mode
        self.num_heads = num_heads
        self.head_dim = inner_dim // num_heads
        self.inner_dim = inner_dim
        self.scale = self.head_dim**-0.5
        if mode == "sequential":
            self.ln_wm = nn.LayerNorm(dim, eps=eps)
            self.ln_rem = nn.LayerNorm(dim, eps=eps)
        else:
            self.ln = nn.LayerNorm(dim, eps=eps)
        self.q_proj = nn.Linear(dim, inner_dim)
        self.kv_proj = nn.Linear(dim, 2 * inner_dim)  # keys and values of all engrams in one matmul
        self.out_proj = OutputProjection(inner_dim, dim)
        self.attn_dropout = attn_dropout
        self.resid_dropout = nn.Dropout(resid_dropout)

    # ------------------------------------------------------------------ helpers
    def _heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)

    def _merge(self, a: Tensor) -> Tensor:
        B, _, T, _ = a.shape
        return a.transpose(1, 2).reshape(B, T, self.inner_dim)  # (B, T, E)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, use_sdpa: bool) -> Tensor:
        """All keys valid (the N working-memory engrams always exist)."""
        p_drop = self.attn_dropout if self.training else 0.0
        if use_sdpa:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop, scale=self.scale)
        probs = (torch.matmul(q, k.transpose(-1, -2)) * self.scale).float().softmax(dim=-1).to(v.dtype)
        return torch.matmul(F.dropout(probs, p_drop, self.training), v)

    def _attend_reminded(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
        """Attention over M_rem that also returns its fp32 probabilities (before dropout).

        `allowed`: (B, R) bool. Rows with no allowed key are given all keys (finite output,
        gated out by the caller) so that softmax never sees an all -inf row.
        """
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # (B, H, L, R)
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        probs = scores.float().softmax(dim=-1)  # (B, H, L, R)
        p_drop = self.attn_dropout if self.training else 0.0
        out = torch.matmul(F.dropout(probs.to(v.dtype), p_drop, self.training), v)  # (B, H, L, hd)
        return out, probs

    @staticmethod
    def _contribution(probs: Tensor, query_mask: Tensor | None) -> Tensor:
        """(B, H, L, R) probabilities -> (B, R) mean over heads and (real) query tokens."""
        per_query = probs.detach().mean(dim=1)  # (B, L, R)
        if query_mask is None:
            return per_query.mean(dim=1)
        m = query_mask.to(per_query.dtype)  # (B, L)
        return (per_query * m[:, :, None]).sum(dim=1) / m.sum(dim=1, keepdim=True).clamp(min=1.0)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: Tensor, engrams: Tensor, mem: MemoryInputs) -> tuple[Tensor, Tensor | None]:
        """Add the memory's contribution to the residual stream.

        Args:
            hidden: (B, L, D) residual stream after the block's self-attention.
            engrams: (B, N + R, D) the working memory (carrying the abstractor's gradient)
                followed by the reminded engrams (constants), concatenated once per forward.
            mem: the per-forward memory inputs.

        Returns:
            The new residual stream (B, L, D) and the (B, R) fp32 contribution of each
            reminded engram (None when R = 0).
        """
        R = mem.reminded_mask.shape[1]
        N = engrams.shape[1] - R
        k, v = self.kv_proj(engrams).split(self.inner_dim, dim=-1)  # (B, N + R, E) each
        k, v = self._heads(k), self._heads(v)  # (B, H, N + R, hd)
        k_wm, v_wm, k_rem, v_rem = k[:, :, :N], v[:, :, :N], k[:, :, N:], v[:, :, N:]
        wm_on = mem.wm_active[:, None, None]  # (B, 1, 1)
        rem_on = mem.reminded_active[:, None, None]
        allowed = mem.reminded_mask | ~mem.reminded_active[:, None]  # (B, R)
        weights = None

        if self.mode == "sequential":
            q = self._heads(self.q_proj(self.ln_wm(hidden)))  # (B, H, L, hd)
            out = self.resid_dropout(self.out_proj(self._merge(self._attend(q, k_wm, v_wm, mem.use_sdpa))))
            hidden = hidden + torch.where(wm_on, out, 0.0)
            if R:
                q = self._heads(self.q_proj(self.ln_rem(hidden)))
                a, probs = self._attend_reminded(q, k_rem, v_rem, allowed)
                out = self.resid_dropout(self.out_proj(self._merge(a)))
                hidden = hidden + torch.where(rem_on, out, 0.0)
                weights = self._contribution(probs, mem.query_mask)
            return hidden, weights

        # parallel: one query, two softmaxes, one output projection
        q = self._heads(self.q_proj(self.ln(hidden)))
        a = torch.where(wm_on[:, :, :, None], self._attend(q, k_wm, v_wm, mem.use_sdpa), 0.0)  # (B, H, L, hd)
        if R:
            a_rem, probs = self._attend_reminded(q, k_rem, v_rem, allowed)
            a = a + torch.where(rem_on[:, :, :, None], a_rem, 0.0)
            weights = self._contribution(probs, mem.query_mask)
        out = self.resid_dropout(self.out_proj(self._merge(a)))
        return hidden + torch.where(wm_on | rem_on, out, 0.0), weights


__all__ = ["MemoryAttention", "MemoryInputs", "OutputProjection"]
