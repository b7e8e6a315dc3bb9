"""Cached keys/values and memory slots inside HF's unmodified GPT-2 self-attention.

`ExtendedKeyValues` stands in for a HF `Cache` in one `GPT2Attention` call (GPT-2 only
calls its `update`): it prepends a layer's cached keys/values (Transformer-XL's memory,
`recurrent/xl.py`), goes through the real decode cache during `generate()`, and keeps this
segment's keys/values for the memory's write. `self_attention_mask` builds the mask over
[cached slots, decode cache, current tokens]. The HF attention code (eager or SDPA) runs
unchanged.

Notation: B rows, Q query tokens, P tokens already in a decode cache, M memory slots,
H heads, hd head width.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache


class ExtendedKeyValues:
    """A stand-in for `Cache` in one `GPT2Attention` call.

    Args:
        memory_keys / memory_values: (B, H, M, hd) cached keys/values of this layer, or None.
        cache: the HF decode cache of the current segment (generation), or None.
    """

    def __init__(self, memory_keys: Tensor | None, memory_values: Tensor | None, cache: Cache | None = None) -> None:
        self.memory_keys = memory_keys
        self.memory_values = memory_values
        self.cache = cache
        self.current: tuple[Tensor, Tensor] | None = None

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        """Called by `GPT2Attention` with this segment's keys/values (B, H, Q, hd)."""
        self.current = (key_states, value_states)  # the next memory is built from these
        if self.cache is not None:
            key_states, value_states = self.cache.update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.memory_keys is not None and self.memory_keys.shape[2] > 0:
            key_states = torch.cat([self.memory_keys.to(key_states.dtype), key_states], dim=2)  # (B, H, M + P + Q, hd)
            value_states = torch.cat([self.memory_values.to(value_states.dtype), value_states], dim=2)
        return key_states, value_states


def self_attention_mask(
    batch_size: int,
    num_queries: int,
    num_past: int,
    memory_mask: Tensor | None,
    key_padding: Tensor | None,
    implementation: str,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor | None:
    """The mask for `GPT2Attention` over keys [memory (M), decode cache (P), current (Q)].

    Args:
        memory_mask: (B, M) bool, which memory slots hold a token, or None (M = 0).
        key_padding: (B, P + Q) bool, False at padded positions of the segment, or None.
        implementation: the backbone's attention implementation (`"sdpa"` or `"eager"`).

    Returns:
        None when SDPA's own causal path is exact (no memory, no padding, and no cache
        or a single query); else (B or 1, 1, Q, M + P + Q): bool (True = attend) for SDPA,
        additive float (0 / dtype min) for eager. Each query always sees itself, so no
        row is empty (an all-masked row would turn into NaN).
    """
    M = 0 if memory_mask is None else memory_mask.shape[1]
    if implementation not in ("sdpa", "eager"):
        raise ValueError(
            f"attention implementation {implementation!r} is not supported by the memory models; use 'sdpa' or 'eager'"
        )
    if implementation == "sdpa" and M == 0 and key_padding is None and (num_past == 0 or num_queries == 1):
        return None
    q_pos = torch.arange(num_queries, device=device)[:, None] + num_past  # (Q, 1)
    k_pos = torch.arange(num_past + num_queries, device=device)[None, :]  # (1, P + Q)
    allowed = (k_pos <= q_pos)[None]  # (1, Q, P + Q)
    if key_padding is not None:
        diagonal = (k_pos == q_pos)[None]
        allowed = (allowed & key_padding[:, None, :].to(device, torch.bool)) | diagonal  # (B, Q, P + Q)
    if M:
        mem = memory_mask.to(device, torch.bool)[:, None, :].expand(-1, num_queries, -1)  # (B, Q, M)
        allowed = torch.cat([mem, allowed.expand(batch_size, -1, -1)], dim=2)  # (B, Q, M + P + Q)
    allowed = allowed[:, None]  # (B or 1, 1, Q, K)
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


__all__ = ["ExtendedKeyValues", "self_attention_mask"]
