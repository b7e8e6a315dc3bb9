"""`xl`: Transformer-XL-style recurrence for an unmodified GPT-2 (Dai et al. 2019, without
their relative positions: GPT-2's are absolute and learned).

Each segment's self-attention also attends to the cached (detached) keys/values of the
last M tokens of the stream, per layer. The read hands each block its layer's cache
(`layer_kv`, prepended by `model/extended_attention.py`); the write rolls this segment's
keys/values into it.

Positions (`MemoriaGPT2Config.xl_positions`). Cached keys/values keep the positions they
were computed at; no absolute scheme can re-position them without recomputing them. With
`"shared"` every segment uses 0..L-1, so a cached key and a current key of the same place
carry the same position, so a head that seeks a position cannot tell the cached token from
the current one (tested; the measured effect on books is in
docs/studies/2026-11-24-real-text.md). With `"alternate"` (the `xl` preset) segments since a
reset alternate between the banks 0..L-1 and S..S+L-1 (S = n_positions // 2), so the cached
previous segment always has other positions than the current one; the read adds the bank
offset from `XLMemory.segments`.
Either way the first segment after a reset is exactly the backbone and any number of
segments runs. Like Transformer-XL, the receptive field grows with depth: the keys cached
at layer l depended on the memory of the segment before, so segment t can depend on up to
`n_layer` earlier segments when M = L.

Notation: B rows, Y layers, H heads, M cached slots, Q tokens of the segment, hd head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...rows import BatchRows, rows_field
from .base import FORMAT, BlockWrites, MemoryKind, MemoryRead, check_format
from .read_copy import held
from .saved_state import BOOL, FLOATS, INT64, SavedState, backbone_sizes


@dataclass
class XLMemory(BatchRows):
    """Transformer-XL memory: detached keys/values of the last M tokens, per layer.

    Attributes:
        keys: (B, Y, H, M, hd) cached keys (the backbone's dtype; detached).
        values: (B, Y, H, M, hd) cached values.
        mask: (B, M) bool, True where a slot holds a token of this row's stream (the
            oldest slots come first; a reset row has none).
        segments: (B,) int64, segments written since the row's last reset (its parity
            picks the position bank of the next segment, `xl_positions="alternate"`).
            None (a memory saved before it existed) reads as zeros.

    Memories of different M stack and exchange rows: the shorter are padded at the old end.
    """

    keys: Tensor = rows_field(pad=(3, "left"))
    values: Tensor = rows_field(pad=(3, "left"))
    mask: Tensor = rows_field(pad=(1, "left"))
    segments: Tensor | None = None

    def __post_init__(self) -> None:
        if self.segments is None:
            self.segments = torch.zeros(self.mask.shape[0], dtype=torch.int64, device=self.mask.device)

    @classmethod
    def empty(
        cls,
        batch_size: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        length: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> XLMemory:
        shape = (batch_size, num_layers, num_heads, length, head_dim)
        return cls(
            keys=torch.zeros(shape, device=device, dtype=dtype),
            values=torch.zeros(shape, device=device, dtype=dtype),
            mask=torch.zeros(batch_size, length, dtype=torch.bool, device=device),
        )

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget all rows, or the rows where the (B,) bool `mask` is True, in place.

        The keys/values of a reset row are zeroed, not only masked: attention gives a masked
        slot probability 0, and 0 * NaN is NaN, so a row left non-finite by a diverged step
        (the training loop resets those without a host sync) must hold zeros, as a fresh one.
        """
        if mask is None:
            for t in (self.mask, self.keys, self.values, self.segments):
                t.zero_()
            return
        mask = mask.to(self.mask.device, torch.bool)
        self.mask.masked_fill_(mask[:, None], False)
        self.segments.masked_fill_(mask, 0)
        rows = mask[:, None, None, None, None]  # (B, 1, 1, 1, 1) over (B, Y, H, M, hd)
        self.keys.masked_fill_(rows, 0.0)
        self.values.masked_fill_(rows, 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "xl", "format": FORMAT, "keys": self.keys, "values": self.values, "mask": self.mask,
                "segments": self.segments}

    @classmethod
    def from_state_dict(
        cls, state_dict: dict[str, Any], config: Any = None, device: torch.device | str | None = None
    ) -> XLMemory:
        check_format(state_dict, "xl")
        out = cls(state_dict["keys"], state_dict["values"], state_dict["mask"], state_dict.get("segments"))
        if (
            out.keys.shape != out.values.shape
            or out.keys.shape[0] != out.mask.shape[0]
            or out.keys.shape[3] != out.mask.shape[1]
            or out.segments.shape != out.mask.shape[:1]
        ):
            raise ValueError(
                f"inconsistent xl memory: keys {tuple(out.keys.shape)}, values {tuple(out.values.shape)}, "
                f"mask {tuple(out.mask.shape)}, segments {tuple(out.segments.shape)}"
            )
        return out.to(device) if device is not None else out


@dataclass
class XLRead(BatchRows, MemoryRead):
    """The blocks' view of an `XLMemory`: every layer's cache and the positions to embed at.

    Attributes:
        keys / values: (B, Y, H, M, hd). slot_mask: (B, M) bool.
        position_offset: (B,) int64 bank offset of this segment's positions, or None (one bank).
    """

    keys: Tensor
    values: Tensor
    slot_mask: Tensor
    position_offset: Tensor | None = None
    engrams: ClassVar[None] = None
    collects_kv: ClassVar[bool] = True

    def positions(self, positions: Tensor) -> Tensor:
        if self.position_offset is None:
            return positions
        return positions + self.position_offset[:, None]  # (B, L)

    def layer_kv(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        if not self.slot_mask.shape[1]:
            return None, None
        return self.keys[:, layer], self.values[:, layer]  # (B, H, M, hd)


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


class XLKind(MemoryKind):
    """Cached keys/values of the last `xl_memory_length` tokens (default: one segment) per layer."""

    name = "xl"
    places = frozenset({"cached slots"})
    memory_class = XLMemory

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> XLMemory:
        """With the model's `segment_length` set, a memory of the slots every write leaves (`xl_memory_length`,
        else one segment's), all empty (every step then sees the same shapes: a compiled step compiles once);
        else of none."""
        cfg = self.config
        length = (cfg.xl_memory_length or cfg.segment_length) if cfg.segment_length else 0
        return XLMemory.empty(batch_size, cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, length, device, dtype)

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: Any = None) -> None:
        s = SavedState(state_dict, "xl", backbone_sizes(config))
        keys = s.tensor("keys", FLOATS, "B Y H M hd")
        s.tensor("values", (keys.dtype,), "B Y H M hd")
        s.tensor("mask", BOOL, "B M")
        if state_dict.get("segments") is not None:  # None: saved before it existed (reads as zeros)
            s.require((s.tensor("segments", INT64, "B") >= 0).all(), "segments", "holds a negative count")
        if config is not None:  # a write keeps the last `xl_memory_length` slots, else one segment's
            s.at_most("mask", "M", config.xl_memory_length or config.n_positions,
                      "`xl_memory_length`" if config.xl_memory_length else "`n_positions`, the longest segment")

    def read(self, memory: XLMemory, dtype: torch.dtype, abstractor: Any) -> tuple[XLRead, None]:
        cfg = self.config
        memory = held(memory)  # the write overwrites the memory in place; the backward needs what was read
        offset = None
        if cfg.position_banks > 1:  # this segment's bank: the other one than the cached segment's
            offset = (memory.segments % cfg.position_banks) * cfg.positions_per_segment
        return XLRead(memory.keys, memory.values, memory.mask, offset), None

    def cached_slots(self, segment_length: int) -> int:
        return self.config.xl_memory_length or segment_length

    def frozen_read(self, memory: XLMemory, dtype: torch.dtype, abstractor: Any) -> XLRead:
        return self.read(memory, dtype, abstractor)[0]  # the read holds copies (`read_copy.held`): a later write leaves it

    def write(
        self, memory: XLMemory, read: XLRead, pending: None, writes: BlockWrites, hidden: Tensor, valid: Tensor
    ) -> None:
        length = self.config.xl_memory_length or valid.shape[1]
        rolled_k, rolled_v = [], []
        for i, (k, v) in enumerate(zip(writes.keys, writes.values)):
            old_k, old_v = read.layer_kv(i)
            rolled_k.append(roll_memory(old_k, memory.mask, k, valid, length))
            rolled_v.append(roll_memory(old_v, memory.mask, v, valid, length)[0])
        # in place: the memory keeps its addresses (a CUDA graph replays over it)
        memory.store_(keys=torch.stack([k for k, _ in rolled_k], dim=1),  # (B, Y, H, M, hd)
                      values=torch.stack(rolled_v, dim=1),
                      mask=rolled_k[0][1].contiguous(),  # not a view of the cat: the same strides every step
                      segments=memory.segments + 1)
        return None


__all__ = ["XLMemory", "XLRead", "XLKind", "roll_memory"]
