"""kNN-augmented self-attention of the Memorizing Transformer (Wu et al., 2022), for one GPT-2 block.

The block's own self-attention (GPT-2's c_attn / c_proj, driven through their modules so
LoRA, ZeRO-3 and HF's weight names are untouched) gives the local result V_c over the
segment (and a decode cache). The same queries also read a kNN memory of that layer's past
(key, value) pairs: per head, the top-k stored keys by cosine similarity (keys are stored
L2-normalised; queries normalised here), attention over those k with a learned per-head
scale (QK-norm, Henry et al. 2020), and the result V_m. A learned per-head gate mixes them
before c_proj:

    g = sigmoid(b_g)            (per head)
    V_a = g * V_m + (1 - g) * V_c

A row whose memory holds nothing (the first segment of a document) takes V_c alone, so it
is exactly the backbone's block. The memory is read-only here (stop-gradient: its tensors
are detached; gradients reach the queries through the retrieval scores).

Notation: B rows, H heads, Q queries, K keys (decode cache + segment), M memory slots,
k retrieved per query, hd head width, D = H * hd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

from .extended_attention import ExtendedKeyValues


@dataclass
class KNNSlots:
    """The memory one forward's kNN attention reads.

    Attributes:
        keys: (B, H, M, hd) float32 L2-normalised keys (detached).
        values: (B, H, M, hd) float32 values (detached).
        mask: (B, M) bool, slots that hold a token of the row's document.
    """

    keys: Tensor
    values: Tensor
    mask: Tensor


# The gate bias b_g under `memory_init="noop"`: g = sigmoid(-4) = 0.018 of the retrieved result at
# the start (the paper trains from scratch and states no init; a pretrained backbone starts close
# to itself and Adam moves b_g by about the learning rate per step).
NOOP_GATE_BIAS = -4.0


def initial_scale(topk: int) -> float:
    """QK-norm's initial scale for attention over `topk` items: log2(k^2 - k) (Henry et al. 2020)."""
    return math.log2(max(topk * topk - topk, 2))


def knn_retrieve(queries: Tensor, slots: KNNSlots, scale: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """V_m: each query's attention over its top-k memory slots by cosine similarity.

    Args:
        queries: (B, H, Q, hd) any dtype (normalised here, in float32).
        slots: the memory.
        scale: (H,) the learned per-head scale of the cosine logits (its absolute value is used, as
            meliad's `attention_scale_factor` takes it: a scale that crosses zero stays a temperature).
        topk: k, slots read per query (fewer while the memory holds fewer).

    Returns:
        (B, H, Q, hd) float32 V_m (0 in rows without a slot), and the (B,) bool rows that had one.
    """
    q = F.normalize(queries.float(), dim=-1)  # (B, H, Q, hd)
    B, H, Q, hd = q.shape
    M = slots.mask.shape[1]
    found = slots.mask.any(dim=1)  # (B,)
    if M == 0:
        return q.new_zeros(B, H, Q, hd), found
    sims = torch.matmul(q, slots.keys.transpose(-1, -2))  # (B, H, Q, M)
    sims = sims.masked_fill(~slots.mask[:, None, None, :], -math.inf)
    top, idx = sims.topk(min(topk, M), dim=-1)  # (B, H, Q, k): exact search
    empty = torch.isinf(top)  # fewer than k slots stored: those picks hold nothing
    logits = (top.masked_fill(empty, 0.0) * scale.float().abs()[None, :, None, None]).masked_fill(empty, -math.inf)
    logits = logits.masked_fill(~found[:, None, None, None], 0.0)  # a row without slots: no NaN (zeroed below)
    weights = torch.softmax(logits, dim=-1)  # (B, H, Q, k)
    k = idx.shape[-1]
    gathered = slots.values.gather(2, idx.reshape(B, H, Q * k, 1).expand(-1, -1, -1, hd))  # (B, H, Q*k, hd)
    v_m = (weights[..., None] * gathered.view(B, H, Q, k, hd)).sum(dim=3)  # (B, H, Q, hd)
    return v_m * found[:, None, None, None], found


def gpt2_attention_scale(attn: GPT2Attention) -> float:
    """The logit scale GPT-2's own attention uses (its config's scaling options)."""
    scale = 1.0 / math.sqrt(attn.head_dim) if attn.scale_attn_weights else 1.0
    if attn.scale_attn_by_inverse_layer_idx:
        scale /= float(attn.layer_idx + 1)
    return scale


class KNNAttention(nn.Module):
    """The learned parts of a kNN-augmented attention: per-head gate bias and cosine scale.

    Args:
        num_heads: H (the backbone's heads).
        topk: k (sets the initial scale).
        gate_bias: b_g at initialisation; None: by the model's `memory_init` (`init_memory_weights`).
    """

    def __init__(self, num_heads: int, topk: int, gate_bias: float | None = None) -> None:
        super().__init__()
        self.topk, self.initial_gate_bias = topk, gate_bias
        self.gate_bias = nn.Parameter(torch.zeros(num_heads))  # b_g; `init_memory_weights` sets it
        self.scale = nn.Parameter(torch.full((num_heads,), initial_scale(topk)))

    @torch.no_grad()
    def init_memory_weights(self, memory_init: str) -> None:
        """The model's init (`_init_weights`): the cosine scale at QK-norm's log2(k^2 - k) (Henry et
        al. 2020); the gate at the kind's `gate_bias` where set, else at an even mix under `random`
        (b = 0), close to the backbone under `noop` (b = -4, g = 0.018; exactly the backbone while a
        row's memory is empty)."""
        nn.init.constant_(self.scale, initial_scale(self.topk))
        bias = self.initial_gate_bias
        if bias is None:
            bias = 0.0 if memory_init == "random" else NOOP_GATE_BIAS
        nn.init.constant_(self.gate_bias, bias)

    def forward(
        self, attn: GPT2Attention, hidden: Tensor, slots: KNNSlots, attention_mask: Tensor | None,
        kv: ExtendedKeyValues,
    ) -> Tensor:
        """GPT-2 block `attn`'s self-attention with the kNN memory mixed in.

        Args:
            attn: the block's HF `GPT2Attention` (its c_attn, c_proj and dropouts are used).
            hidden: (B, Q, D) the block's ln_1 output.
            slots: the kNN memory of this layer.
            attention_mask: the self-attention mask (`extended_attention.self_attention_mask`
                over [decode cache, segment]; no prepended slots), or None (causal).
            kv: the block's key/value hand-off: the decode cache, and this segment's
                keys/values kept for the memory's write.

        Returns:
            (B, Q, D) the attention output after c_proj and residual dropout.
        """
        B, Q, D = hidden.shape
        H, hd = attn.num_heads, attn.head_dim
        q, k, v = attn.c_attn(hidden).split(attn.split_size, dim=2)
        q, k, v = (t.view(B, Q, H, hd).transpose(1, 2) for t in (q, k, v))  # (B, H, Q, hd)
        k_all, v_all = kv.update(k, v, attn.layer_idx)  # (B, H, K, hd)
        dropout = attn.attn_dropout.p if self.training else 0.0
        causal = attention_mask is None and Q > 1  # None: no past, or one query that sees everything
        v_c = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attention_mask, dropout_p=dropout,
                                             is_causal=causal, scale=gpt2_attention_scale(attn))  # (B, H, Q, hd)
        v_m, found = knn_retrieve(q, slots, self.scale, self.topk)
        g = torch.sigmoid(self.gate_bias.float())[None, :, None, None]  # (1, H, 1, 1)
        mixed = (g * v_m + (1.0 - g) * v_c.float()).to(v_c.dtype)
        v_a = torch.where(found[:, None, None, None], mixed, v_c)  # (B, H, Q, hd)
        out = v_a.transpose(1, 2).reshape(B, Q, D)  # (B, Q, D)
        return attn.resid_dropout(attn.c_proj(out))


__all__ = ["NOOP_GATE_BIAS", "KNNAttention", "KNNSlots", "gpt2_attention_scale", "initial_scale", "knn_retrieve"]
