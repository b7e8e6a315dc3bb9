"""Memory cross-attention: one module, two uses (WM, then the reminded engrams M_rem).

SPEC section 2 / paper Figure 10: after a block's self-attention, the tokens attend to
the working memory and, with the *same* attention weights, to the reminded engrams; each
use adds its own residual. The attention probabilities of the M_rem use (before dropout)
are each reminded engram's contribution `w_i` (SPEC step 8): their mean over heads and
query tokens is returned per block, and the model averages it over blocks.

Notation: B rows, L query tokens, N = N_wm engrams, R reminded slots (M_rem, padded),
D model width, H heads, E = H * hd the attention's inner width.

Few, large operations (issue 16): the keys and values of all N + R engrams come from one
projection (every block's at once, `engram_key_values`, issue 48), and each use attends over all
of them with a mask that leaves only its own
engrams (a masked key's probability is exactly 0, so each use computes what an attention
over its own engrams alone computes); no slices of the keys and values, so no per-slice
backward. The masks and gates are built once per forward (`MemoryInputs`), not per block.
With SDPA the M_rem probabilities are recomputed without gradient for the contribution
(the attention itself runs fused, forward and backward): each block hands back what its M_rem
use attended with (`RemindedRead`) and `contribution` computes every block's probabilities in
one batched matmul and softmax after the last block, not a dozen small ops per block.

Rows without memory (the first segment after a reset) and rows with no reminded engram
are gated out with `torch.where`, which gives an exact zero (never 0 * garbage): such a
row computes exactly what the plain backbone computes. Shapes never depend on the data,
so the same modules run in every step (ZeRO-3's module trace and CUDA graphs stay valid).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        use_sdpa: run the attentions through `F.scaled_dot_product_attention`.
        num_wm: N; given (with `dtype`, the engrams' dtype), the masks are built here once
            for all blocks, else by each block.
        masks: the per-forward `EngramMasks` (derived).
    """

    wm_active: Tensor
    reminded_mask: Tensor
    reminded_active: Tensor
    query_mask: Tensor | None
    use_sdpa: bool
    num_wm: int | None = None
    dtype: torch.dtype | None = None
    masks: EngramMasks | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.num_wm is not None:
            self.masks = EngramMasks.build(self, self.num_wm, self.dtype or torch.float32)

    def masks_for(self, num_wm: int, dtype: torch.dtype) -> EngramMasks:
        if self.masks is not None and self.masks.num_wm == num_wm and self.masks.dtype == dtype:
            return self.masks
        return EngramMasks.build(self, num_wm, dtype)


@dataclass
class EngramMasks:
    """Additive key masks over the N + R engrams, and the row gates, of one forward.

    Attributes:
        num_wm, dtype: what they were built for.
        wm_keys: (1, 1, 1, N + R) 0 on the WM engrams, -inf on the reminded ones; None if R = 0.
        rem_keys: (B, 1, 1, N + R) -inf on the WM engrams and on padded reminded slots (a
            row with no reminded engram gets all of its R slots: finite, gated out).
        wm_gate, rem_gate, any_gate: (B, 1, 1) bool rows whose use counts.
        zero: 0-dim 0 in `dtype`, what a gated-out row adds (one tensor for every block, not one per use).
    """

    num_wm: int
    dtype: torch.dtype
    wm_keys: Tensor | None
    rem_keys: Tensor | None
    wm_gate: Tensor
    rem_gate: Tensor
    any_gate: Tensor
    zero: Tensor

    @classmethod
    def build(cls, mem: MemoryInputs, num_wm: int, dtype: torch.dtype) -> EngramMasks:
        B, R = mem.reminded_mask.shape
        device = mem.reminded_mask.device
        wm_keys = rem_keys = None
        if R:
            blocked = torch.full((), float("-inf"), dtype=dtype, device=device)
            wm_keys = torch.cat([torch.zeros(num_wm, dtype=dtype, device=device), blocked.expand(R)])[None, None, None]
            allowed = mem.reminded_mask | ~mem.reminded_active[:, None]  # (B, R)
            rem_keys = torch.cat([blocked.expand(B, num_wm), torch.where(allowed, 0.0, blocked)], dim=1)
            rem_keys = rem_keys[:, None, None, :]
        wm_gate, rem_gate = mem.wm_active[:, None, None], mem.reminded_active[:, None, None]
        return cls(num_wm, dtype, wm_keys, rem_keys, wm_gate, rem_gate, wm_gate | rem_gate,
                   torch.zeros((), dtype=dtype, device=device))


@dataclass
class RemindedRead:
    """What one block's read of the reminded engrams attended with, for their contribution (no gradient).

    Attributes:
        queries: (B, H, L, hd) the read's queries, detached (SDPA ran the attention), or None.
        keys: (B, H, R, hd) the reminded engrams' keys, detached, or None.
        scale: the logits' scale.
        probs: (B, H, L, R) fp32 probabilities before dropout, when the attention made them (eager).
    """

    queries: Tensor | None = None
    keys: Tensor | None = None
    scale: float = 1.0
    probs: Tensor | None = None


@torch.no_grad()
def contribution(reads: list[RemindedRead], mem: MemoryInputs) -> Tensor:
    """(B, R) fp32 contribution of each reminded engram (SPEC step 8): its attention probability
    before dropout, averaged over the blocks, heads and real query tokens, every block at once.

    The M_rem logits of all blocks come from one batched matmul in the queries' dtype (then fp32,
    as each block's attention makes them); padded slots get probability 0; a row with no reminded
    engram gets finite values over all R slots (the model gates it out).
    """
    if all(r.probs is not None for r in reads):
        probs = torch.stack([r.probs for r in reads])  # (Y, B, H, L, R)
    else:
        queries = torch.stack([r.queries for r in reads])  # (Y, B, H, L, hd)
        keys = torch.stack([r.keys for r in reads])  # (Y, B, H, R, hd)
        scales = {r.scale for r in reads}
        scale = scales.pop() if len(scales) == 1 else queries.new_tensor([r.scale for r in reads])[:, None, None, None,
                                                                                                    None]
        allowed = mem.reminded_mask | ~mem.reminded_active[:, None]  # (B, R)
        blocked = torch.where(allowed, 0.0, float("-inf")).to(queries.dtype)[:, None, None, :]  # (B, 1, 1, R)
        probs = (torch.matmul(queries, keys.transpose(-1, -2)) * scale + blocked).float().softmax(dim=-1)
    return MemoryAttention.contribution(probs.mean(dim=0), mem.query_mask)


def engram_key_values(attentions: list[MemoryAttention], engrams: Tensor) -> tuple[Tensor, ...] | None:
    """The engrams' keys and values for every block's memory attention, in one projection.

    Each block's `kv_proj` weights are concatenated (the blocks' own parameters: names, init and
    checkpoints unchanged) and the engrams projected once, instead of one small matmul per block
    and its backward (issue 48). The arithmetic is the per-block projections'; only the blocking
    of one larger matmul may differ (at the `gpt2` shape on CPU: losses and logits bit-equal,
    gradients within 5e-6 relative; tests/model/test_engram_projection.py).

    Args:
        attentions: the memory attentions of the blocks that have one, in block order.
        engrams: (B, T, D) the engrams every block reads.

    Returns:
        One (2, B, H, T, hd) tensor per attention, its keys then its values; or None where an adapter
        wraps a projection (peft): each block then projects through its own module. Under ZeRO-3,
        DeepSpeed gathers the weights read here for the forward and the backward (its discovery of
        parameters read outside their module, tests/model/test_zero3.py).
    """
    projections = [a.kv_proj for a in attentions]
    if not projections or any(type(p) is not nn.Linear for p in projections):
        return None
    first = attentions[0]
    weight = torch.cat([p.weight for p in projections])  # (Y * 2E, D)
    bias = torch.cat([p.bias for p in projections])
    B, T, _ = engrams.shape
    kv = F.linear(engrams, weight, bias).view(B, T, len(projections), 2, first.num_heads, first.head_dim)
    return kv.permute(2, 3, 0, 4, 1, 5).unbind(0)  # Y x (2, B, H, T, hd)


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

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor | None,
                use_sdpa: bool) -> tuple[Tensor, Tensor | None]:
        """Attention over the N + R engrams with the additive mask `keys` (None: all).

        Returns the output (B, H, L, hd) and, without SDPA, the fp32 probabilities before
        dropout (B, H, L, N + R); with SDPA, None."""
        p_drop = self.attn_dropout if self.training else 0.0
        if use_sdpa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keys, dropout_p=p_drop, scale=self.scale), None
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if keys is not None:
            scores = scores + keys
        probs = scores.float().softmax(dim=-1)
        return torch.matmul(F.dropout(probs.to(v.dtype), p_drop, self.training), v), probs

    def _reminded_read(self, q: Tensor, k: Tensor, masks: EngramMasks, probs: Tensor | None) -> RemindedRead:
        """What the M_rem use attended with: its fp32 probabilities before dropout if the attention
        made them, else its queries and the reminded keys (`contribution` recomputes them)."""
        N = masks.num_wm
        if probs is not None:
            return RemindedRead(probs=probs[..., N:].detach())
        return RemindedRead(queries=q.detach(), keys=k[:, :, N:].detach(), scale=self.scale)

    @staticmethod
    def contribution(probs: Tensor, query_mask: Tensor | None) -> Tensor:
        """(B, H, L, R) probabilities -> (B, R) mean over heads and (real) query tokens."""
        if query_mask is None:
            return probs.mean(dim=(1, 2))
        m = query_mask.to(probs.dtype)  # (B, L)
        per_query = probs.mean(dim=1)  # (B, L, R)
        return (per_query * m[:, :, None]).sum(dim=1) / m.sum(dim=1, keepdim=True).clamp(min=1.0)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: Tensor, engrams: Tensor, mem: MemoryInputs,
                key_values: Tensor | None = None) -> tuple[Tensor, RemindedRead | None]:
        """Add the memory's contribution to the residual stream.

        Args:
            hidden: (B, L, D) residual stream after the block's self-attention.
            engrams: (B, N + R, D) the working memory (carrying the abstractor's gradient)
                followed by the reminded engrams (constants), concatenated once per forward.
            mem: the per-forward memory inputs.
            key_values: (2, B, H, N + R, hd) this block's projection of `engrams`, made for every
                block at once (`engram_key_values`), or None: projected here.

        Returns:
            The new residual stream (B, L, D) and what the M_rem use attended with (None when
            R = 0): `contribution([...], mem)` gives the (B, R) fp32 contribution of each engram.
        """
        R = mem.reminded_mask.shape[1]
        masks = mem.masks_for(engrams.shape[1] - R, engrams.dtype)
        if key_values is None:
            k, v = self.kv_proj(engrams).split(self.inner_dim, dim=-1)  # (B, N + R, E) each: one projection
            k, v = self._heads(k), self._heads(v)  # (B, H, N + R, hd)
        else:
            k, v = key_values.unbind(0)
        reminded = None

        if self.mode == "sequential":
            q = self._heads(self.q_proj(self.ln_wm(hidden)))  # (B, H, L, hd)
            a, _ = self._attend(q, k, v, masks.wm_keys, mem.use_sdpa)
            hidden = hidden + torch.where(masks.wm_gate, self.resid_dropout(self.out_proj(self._merge(a))), masks.zero)
            if R:
                q = self._heads(self.q_proj(self.ln_rem(hidden)))
                a, probs = self._attend(q, k, v, masks.rem_keys, mem.use_sdpa)
                hidden = hidden + torch.where(masks.rem_gate, self.resid_dropout(self.out_proj(self._merge(a))),
                                              masks.zero)
                reminded = self._reminded_read(q, k, masks, probs)
            return hidden, reminded

        # parallel: one query, two softmaxes, one output projection
        q = self._heads(self.q_proj(self.ln(hidden)))
        a_wm, _ = self._attend(q, k, v, masks.wm_keys, mem.use_sdpa)
        a = torch.where(masks.wm_gate[..., None], a_wm, masks.zero)  # (B, H, L, hd)
        if R:
            a_rem, probs = self._attend(q, k, v, masks.rem_keys, mem.use_sdpa)
            a = a + torch.where(masks.rem_gate[..., None], a_rem, masks.zero)
            reminded = self._reminded_read(q, k, masks, probs)
        out = self.resid_dropout(self.out_proj(self._merge(a)))
        return hidden + torch.where(masks.any_gate, out, masks.zero), reminded


__all__ = ["MemoryAttention", "MemoryInputs", "EngramMasks", "OutputProjection", "RemindedRead", "contribution",
           "engram_key_values"]
