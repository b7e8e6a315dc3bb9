"""The encoder's memory attention: one module, two uses (the working memory, then the reminded engrams).

The authors' encoder layer (cosmoquester/memoria, experiment/longseq_formers/model/memoria_bert/
modeling_memoria_bert.py, `MemoriaBertLayer.forward`) calls one HF `BertAttention` twice after the
layer's self-attention, as a cross-attention: first over the working memory, then over the reminded
engrams, each time from the stream the previous call left:

    a = LayerNorm(a + dense(Attn(a, WM)))          # their BertSelfOutput: post-norm residual
    a = LayerNorm(a + dense(Attn(a, M_rem)))       # the same weights, the same LayerNorm

`memory_residual="post_norm"` computes exactly that; `"add"` (the default) leaves the normalisation
out, `a = a + out(Attn(a, ...))`, so that a zero output projection makes the module an exact no-op
(docs/encoders.md, "Initialisation"). Everything else is the toolkit's GPT-2 memory attention
(`..memory_attention.MemoryAttention`, reused here): q from the stream, keys and values of all
N + R engrams from one projection (their `key` and `value` weights side by side), multi-head,
1/sqrt(head width), the backbone's attention-probability and output dropouts, masks built once
per forward, SDPA or eager, the M_rem probabilities handed back for the contribution.

A row without a reminded engram (a fresh document) reads a zero context in the M_rem use: what the
authors' attention over an empty memory gives (a softmax over no key, then probabilities @ values
= 0), so in `post_norm` that use still adds the projection's bias and normalises, as theirs does;
in `add` the use adds exactly nothing.

Notation: B rows, L tokens, N = N_wm engrams, R reminded slots, D width, H heads, hd head width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..memory_attention import MemoryAttention, MemoryInputs, RemindedRead


class EncoderMemoryAttention(MemoryAttention):
    """Cross-attention from a layer's stream to [WM, M_rem], used twice, with the authors' or an additive residual.

    Args:
        dim: D, the backbone's hidden size (the q/k/v width too: the authors' `BertAttention`).
        num_heads: H (the backbone's `num_attention_heads`).
        residual: `"add"` or `"post_norm"` (module docstring).
        eps: the backbone's layer-norm epsilon.
        attn_dropout: dropout on the attention probabilities (`attention_probs_dropout_prob`).
        resid_dropout: dropout on the output projection (`hidden_dropout_prob`).
    """

    def __init__(self, dim: int, num_heads: int, residual: str, eps: float, attn_dropout: float,
                 resid_dropout: float) -> None:
        # "parallel" builds one layer norm (`self.ln`), which is the authors' one BertSelfOutput.LayerNorm
        super().__init__(dim, num_heads, dim, "parallel", eps, attn_dropout, resid_dropout)
        self.residual = residual
        if residual == "add":
            self.ln = None  # no normalisation: no weights that would never be used

    def _join(self, hidden: Tensor, attended: Tensor, gate: Tensor) -> Tensor:
        """The stream after one use. attended: (B, H, L, hd); gate: (B, 1, 1) rows whose use has engrams."""
        if self.ln is None:  # add: a gated-out row gets an exact zero (never 0 * x)
            return hidden + torch.where(gate, self.resid_dropout(self.out_proj(self._merge(attended))), 0.0)
        context = torch.where(gate[..., None], attended, 0.0)  # no engram: a zero context, as theirs
        return self.ln(hidden + self.resid_dropout(self.out_proj(self._merge(context))))

    def forward(self, hidden: Tensor, engrams: Tensor, mem: MemoryInputs,
                key_values: Tensor | None = None) -> tuple[Tensor, RemindedRead | None]:
        """Attend to the working memory, then to the reminded engrams.

        Args:
            hidden: (B, L, D) the layer's self-attention output (after its own LayerNorm).
            engrams: (B, N + R, D) the working memory (with the abstractor's gradient), then the
                reminded engrams (constants).
            mem: the per-forward memory inputs (masks, gates).
            key_values: (2, B, H, N + R, hd) this layer's projection of `engrams`, made for every layer at
                once (`memory_attention.engram_key_values`), or None: projected here.

        Returns:
            The stream (B, L, D) for the layer's feed-forward sublayer, and what the M_rem use attended
            with (None when R = 0), from which `memory_attention.contribution` gives each engram's weight.
        """
        R = mem.reminded_mask.shape[1]
        masks = mem.masks_for(engrams.shape[1] - R, engrams.dtype)
        if key_values is None:
            k, v = self.kv_proj(engrams).split(self.inner_dim, dim=-1)  # (B, N + R, D) each
            k, v = self._heads(k), self._heads(v)  # (B, H, N + R, hd)
        else:
            k, v = key_values.unbind(0)

        q = self._heads(self.q_proj(hidden))  # (B, H, L, hd)
        attended, _ = self._attend(q, k, v, masks.wm_keys, mem.use_sdpa)
        hidden = self._join(hidden, attended, masks.wm_gate)
        if not R:  # no reminded slot at all: the second use reads nothing (a zero context)
            if self.ln is not None:
                hidden = self._join(hidden, torch.zeros_like(q), torch.zeros_like(masks.wm_gate))
            return hidden, None
        q = self._heads(self.q_proj(hidden))
        attended, probs = self._attend(q, k, v, masks.rem_keys, mem.use_sdpa)
        hidden = self._join(hidden, attended, masks.rem_gate)
        return hidden, self._reminded_read(q, k, masks, probs)


__all__ = ["EncoderMemoryAttention"]
