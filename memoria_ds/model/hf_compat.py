"""What memoria_ds copies of transformers' GPT-2: the names it gives the decode cache (which
changed in 5.24), and its self-attention, run here where its queries are needed.

transformers 5.23 calls it `past_key_values` everywhere; 5.24 renames it `cache` in every
`ModelOutput`, in `GPT2Attention.forward` and in what `generate()` passes to `forward`
(the old name is a deprecated alias until 5.40). memoria_ds reads the installed version's
own classes once, here, and uses the name they use.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, eager_attention_forward

OUTPUT_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
ATTENTION_CACHE = "cache" if "cache" in inspect.signature(GPT2Attention.forward).parameters else "past_key_values"


def self_attention_with_queries(attn: GPT2Attention, hidden: Tensor, attention_mask: Tensor | None,
                                cache: Any) -> tuple[Tensor, Tensor]:
    """`attn(hidden, attention_mask=attention_mask, cache=cache)`, GPT-2's self-attention as
    `GPT2Attention.forward` runs it (its modules, so LoRA and ZeRO-3 see them; its attention
    implementation and options), returning its queries too.

    `GPT2Attention` keeps its queries to itself; a forward hook on its `c_attn` would hand them
    out, but registering a hook inside a compiled forward is a graph break. The same steps here
    compute the same values.

    Args:
        attn: a block's HF `GPT2Attention`. hidden: (B, L, D) its `ln_1` output.
        attention_mask: the self-attention mask, or None (causal). cache: the block's key/value
            hand-off (`ExtendedKeyValues`) or decode cache, or None.

    Returns:
        (B, L, D) the attention's output after `c_proj` and dropout, and its (B, H, L, hd) queries.
    """
    query, key, value = attn.c_attn(hidden).split(attn.split_size, dim=2)
    shape = (*query.shape[:-1], -1, attn.head_dim)
    query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))  # (B, H, L, hd)
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx)  # (B, H, K, hd)
    implementation = attn.config._attn_implementation
    if implementation == "eager" and attn.reorder_and_upcast_attn:
        out, _ = attn._upcast_and_reordered_attn(query, key, value, attention_mask)
    else:
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        dropout = attn.attn_dropout.p if attn.training else 0.0
        out, _ = interface(attn, query, key, value, attention_mask, dropout=dropout, scaling=attn.scaling)
    out = out.reshape(*out.shape[:-2], -1).contiguous()  # (B, L, D)
    return attn.resid_dropout(attn.c_proj(out)), query


__all__ = ["ATTENTION_CACHE", "OUTPUT_CACHE", "self_attention_with_queries"]
