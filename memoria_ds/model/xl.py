"""Transformer-XL-style recurrence for an unmodified GPT-2, and the self-attention masks.

Each segment's self-attention also attends to the cached (detached) keys/values of the
last M tokens of the stream, per layer (Dai et al. 2019, without their relative
positions: GPT-2's are absolute and learned).

Positions (`MemoriaGPT2Config.xl_positions`). Cached keys/values keep the positions they
were computed at; no absolute scheme can re-position them without recomputing them. With
`"shared"` every segment uses 0..L-1, so a cached key and a current key of the same place
carry the same position, so a head that seeks a position cannot tell the cached token from
the current one (tested; the measured effect on books is in docs/model.md). With
`"alternate"` (the `xl` preset) segments since a
reset alternate between the banks 0..L-1 and S..S+L-1 (S = n_positions // 2), so the
cached previous segment always has other positions than the current one; the model adds
the bank offset to the positions it embeds, from `XLMemory.segments`. Either way the first
segment after a reset is exactly the backbone and any number of segments runs. Like
Transformer-XL, the receptive field grows with depth: the keys cached at layer l depended
on the memory of the segment before, so segment t can depend on up to `n_layer` earlier
segments when M = L.

The cached keys/values reach `GPT2Attention` through its `past_key_values` argument:
`ExtendedKeyValues` stands in for a HF `Cache` (GPT-2 only calls its `update`), prepends
the memory and, during `generate()`, goes through the real decode cache. The HF attention
code (eager or SDPA) runs unchanged.

Notation: B rows, Q query tokens, P tokens already in a decode cache, M memory slots,
H heads, hd head width, Y layers.
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


def roll_memory(
    memory: Tensor | None, memory_mask: Tensor | None, current: Tensor, current_mask: Tensor, length: int
) -> tuple[Tensor, Tensor]:
    """The next memory of one layer: the last `length` of [memory, current], detached.

    Args:
        memory: (B, H, M, hd) or None. memory_mask: (B, M) or None.
        current: (B, H, Q, hd) this segment's keys (or values). current_mask: (B, Q) bool.
        length: slots to keep; fewer available are padded at the old end as empty.

    Returns:
        (B, H, length, hd) detached tensor and its (B, length) bool mask.
    """
    current = current.detach()
    if memory is not None and memory.shape[2]:
        full = torch.cat([memory.to(current.dtype), current], dim=2)
        full_mask = torch.cat([memory_mask, current_mask], dim=1)
    else:
        full, full_mask = current, current_mask
    if full.shape[2] >= length:
        return full[:, :, -length:], full_mask[:, -length:]
    missing = length - full.shape[2]
    B, H, _, hd = full.shape
    full = torch.cat([full.new_zeros(B, H, missing, hd), full], dim=2)
    full_mask = torch.cat([full_mask.new_zeros(B, missing), full_mask], dim=1)
    return full, full_mask


__all__ = ["ExtendedKeyValues", "self_attention_mask", "roll_memory"]
