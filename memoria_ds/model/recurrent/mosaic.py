"""`mosaic`: a Memory Mosaic's contextual memory carried across segments.

No published Memory Mosaic carries its memories from one segment to the next: each reads
its segment alone. This kind keeps, per block and row, what the next segment needs to read
the stream as if it were one long sequence:

- the last M complete key/value pairs of the contextual memory (detached, as Transformer-XL
  caches keys/values), read by every position of the next segment beside its own pairs;
- the pending pair of the segment's last position: its key and its raw value projection
  W_psi x_{L-1}, whose value completes with the next segment's first token;
- the unnormalised leaky averages kbar of the contextual and the persistent keys at the
  last position, which the next segment's leaky averages continue.

With M at least the stream's length so far, reading a stream segment by segment gives the
logits of reading it at once (tests/model/test_mosaic_carry.py). With a smaller M the oldest
pairs are forgotten (the leaky averages still reach back without limit).

Notation: B rows, Y blocks, H heads, M slots, hd head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...rows import BatchRows, pad_to, rows_field
from ..composition import OWN_MODEL
from .base import FORMAT, MemoryKind, MemoryRead, check_format
from .read_copy import held
from .saved_state import BOOL, FLOATS, SavedState, backbone_sizes


@dataclass
class ContextCarry:
    """One block's contextual memory carried between segments (rows first).

    `MosaicMemory.layer(i)` makes it; `mosaic/units.py` reads it and returns the next one.

    Attributes:
        keys / values: (B, H, M, hd) stored pairs; mask: (B, M) bool, which slots hold one.
        last_key: (B, H, hd) the previous segment's last key (its value waits for the next token);
        last_raw: (B, H, hd) W_psi x of that position; kbar: (B, H, hd) its unnormalised leaky
        average; has_last: (B,) bool, whether there was such a position (False after a reset).
    """

    keys: Tensor
    values: Tensor
    mask: Tensor
    last_key: Tensor
    last_raw: Tensor
    kbar: Tensor
    has_last: Tensor


@dataclass
class MosaicMemory(BatchRows):
    """The carried contextual memories of every block.

    Attributes:
        keys / values: (B, Y, H, M, hd) stored pairs (oldest first); mask: (B, M) bool, which slots hold one.
        last_key / last_raw: (B, Y, H, hd) the last position's key and W_psi x (its value pends).
        kbar: (B, Y, 2, H, hd) the last position's leaky averages (contextual key, persistent key).
        has_last: (B,) bool, a previous segment exists (False when fresh or reset).
    """

    keys: Tensor = rows_field(pad=(3, "left"))
    values: Tensor = rows_field(pad=(3, "left"))
    mask: Tensor = rows_field(pad=(1, "left"))
    last_key: Tensor = None
    last_raw: Tensor = None
    kbar: Tensor = None
    has_last: Tensor = None

    @classmethod
    def empty(cls, batch_size: int, num_layers: int, num_heads: int, head_dim: int,
              device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
              length: int = 0) -> MosaicMemory:
        """A fresh memory of `length` (M) empty slots."""
        def zeros(*shape):
            return torch.zeros(batch_size, *shape, device=device, dtype=dtype)

        return cls(keys=zeros(num_layers, num_heads, length, head_dim),
                   values=zeros(num_layers, num_heads, length, head_dim),
                   mask=torch.zeros(batch_size, length, dtype=torch.bool, device=device),
                   last_key=zeros(num_layers, num_heads, head_dim), last_raw=zeros(num_layers, num_heads, head_dim),
                   kbar=zeros(num_layers, 2, num_heads, head_dim),
                   has_last=torch.zeros(batch_size, dtype=torch.bool, device=device))

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget all rows, or those where the (B,) bool `mask` is True, in place (zeroed, not only
        masked: a row left non-finite by a diverged step must read as a fresh one)."""
        tensors = (self.keys, self.values, self.last_key, self.last_raw, self.kbar)
        if mask is None:
            for t in (*tensors, self.mask, self.has_last):
                t.zero_()
            return
        mask = mask.to(self.mask.device, torch.bool)
        self.mask.masked_fill_(mask[:, None], False)
        self.has_last.masked_fill_(mask, False)
        for t in tensors:
            t.masked_fill_(mask.view(-1, *([1] * (t.dim() - 1))), 0.0)

    def layer(self, i: int) -> tuple[ContextCarry, Tensor]:
        """Block i's view: its contextual memory's carry, and the persistent key's kbar (B, H, hd)."""
        carry = ContextCarry(keys=self.keys[:, i], values=self.values[:, i], mask=self.mask,
                             last_key=self.last_key[:, i], last_raw=self.last_raw[:, i], kbar=self.kbar[:, i, 0],
                             has_last=self.has_last)
        return carry, self.kbar[:, i, 1]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mosaic", "format": FORMAT, "keys": self.keys, "values": self.values, "mask": self.mask,
                "last_key": self.last_key, "last_raw": self.last_raw, "kbar": self.kbar, "has_last": self.has_last}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], config: Any = None,
                        device: torch.device | str | None = None) -> MosaicMemory:
        check_format(state_dict, "mosaic")
        out = cls(*(state_dict[k] for k in ("keys", "values", "mask", "last_key", "last_raw", "kbar", "has_last")))
        B, Y, H, M, hd = out.keys.shape
        shapes = {"values": (out.values.shape, (B, Y, H, M, hd)), "mask": (out.mask.shape, (B, M)),
                  "last_key": (out.last_key.shape, (B, Y, H, hd)), "last_raw": (out.last_raw.shape, (B, Y, H, hd)),
                  "kbar": (out.kbar.shape, (B, Y, 2, H, hd)), "has_last": (out.has_last.shape, (B,))}
        bad = [f"{k} {tuple(got)} (expected {want})" for k, (got, want) in shapes.items() if tuple(got) != want]
        if bad:
            raise ValueError(f"inconsistent mosaic memory: keys {(B, Y, H, M, hd)}, " + ", ".join(bad))
        return out.to(device) if device is not None else out


@dataclass
class MosaicRead(MemoryRead):
    """The blocks' view of a `MosaicMemory` (`layer(i)`); nothing for GPT-2's hooks."""

    memory: MosaicMemory
    engrams: ClassVar[None] = None
    slot_mask: ClassVar[None] = None

    def layer(self, i: int) -> tuple[ContextCarry, Tensor]:
        return self.memory.layer(i)


class MosaicKind(MemoryKind):
    """Carries each block's contextual memory: the last `mosaic_memory_length` pairs (default: one segment)."""

    name = "mosaic"
    places = frozenset({OWN_MODEL})  # the Memory Mosaic's own model: composes with nothing
    memory_class = MosaicMemory

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> MosaicMemory:
        """With the model's `segment_length` set, a memory of the slots every write leaves
        (`mosaic_memory_length`, else one segment's), all empty (every step then sees the same shapes: a
        compiled step compiles once); else of none."""
        cfg = self.config
        return MosaicMemory.empty(batch_size, cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, device, dtype,
                                  self._fresh_length())

    def _fresh_length(self) -> int:
        """The slots of a fresh memory: every write's (`mosaic_memory_length`, else one segment's)
        with the model's `segment_length` set, else none."""
        cfg = self.config
        return (cfg.mosaic_memory_length or cfg.segment_length) if cfg.segment_length else 0

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: Any = None) -> None:
        s = SavedState(state_dict, "mosaic", backbone_sizes(config))
        keys = s.tensor("keys", FLOATS, "B Y H M hd")
        for name, dims in (("values", "B Y H M hd"), ("last_key", "B Y H hd"), ("last_raw", "B Y H hd"),
                           ("kbar", "B Y 2 H hd")):
            s.tensor(name, (keys.dtype,), dims)
        s.tensor("mask", BOOL, "B M")
        s.tensor("has_last", BOOL, "B")
        if config is not None:  # a write keeps the last `mosaic_memory_length` pairs, else one segment's
            length = config.mosaic_memory_length
            s.at_most("mask", "M", length or config.n_positions,
                      "`mosaic_memory_length`" if length else "`n_positions`, the longest segment")

    def prepare(self, memory: MosaicMemory | None, batch_size: int, device: torch.device, dtype: torch.dtype,
                reset: Tensor | None) -> MosaicMemory:
        """The base's, then a memory shorter than a fresh one (made without `segment_length`, or saved
        while filling) padded at its old end with empty slots: the steps that fill it would each see
        another shape (a compiled step recompiling at each)."""
        memory = super().prepare(memory, batch_size, device, dtype, reset)
        length = self._fresh_length()
        if memory.length < length:
            memory.keys, memory.values = (pad_to(t, length, 3, "left") for t in (memory.keys, memory.values))
            memory.mask = pad_to(memory.mask, length, 1, "left")
        return memory

    def check(self, memory: MosaicMemory) -> None:
        cfg = self.config
        want = (cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head)
        got = (memory.keys.shape[1], memory.keys.shape[2], memory.keys.shape[4])
        if got != want:
            raise ValueError(f"mosaic memory of {got} (blocks, heads, head width) for a model of {want}")

    def read(self, memory: MosaicMemory, dtype: torch.dtype, abstractor: Any) -> tuple[MosaicRead, None]:
        return MosaicRead(held(memory)), None  # the write overwrites the memory in place: the backward reads a copy

    def frozen_read(self, memory: MosaicMemory, dtype: torch.dtype, abstractor: Any) -> MosaicRead:
        return self.read(memory, dtype, abstractor)[0]  # the read holds copies (`read_copy.held`): a later write leaves it

    def write(self, memory: MosaicMemory, read: MosaicRead, pending: None, writes: list[tuple[ContextCarry, Tensor]],
              hidden: Tensor, valid: Tensor) -> None:
        """Keep the last M slots of what each block read and added (`writes`: per block, the
        contextual memory's new carry and the persistent key's kbar)."""
        length = self.config.mosaic_memory_length or valid.shape[1]
        carries = [c for c, _ in writes]
        keys = torch.stack([c.keys for c in carries], 1)  # (B, Y, H, S, hd): S = M_old + 1 + L - 1 slots
        values = torch.stack([c.values for c in carries], 1)
        mask = carries[0].mask  # (B, S): the same slots in every block
        if keys.shape[3] >= length:  # copies, not views of the longer tensors: the same strides every step
            keys, values, mask = (t.contiguous() for t in (keys[:, :, :, -length:], values[:, :, :, -length:],
                                                            mask[:, -length:]))
        dtype = memory.keys.dtype
        memory.store_(  # in place (`BatchRows.store_`): the memory keeps its addresses
            keys=keys.to(dtype), values=values.to(dtype), mask=mask,
            last_key=torch.stack([c.last_key for c in carries], 1).to(dtype),
            last_raw=torch.stack([c.last_raw for c in carries], 1).to(dtype),
            kbar=torch.stack([torch.stack([c.kbar, pm.detach()], 1) for c, pm in writes], 1).to(dtype),
            has_last=carries[0].has_last.contiguous())  # a column of the padding mask: copied, as above
        return None


__all__ = ["ContextCarry", "MosaicMemory", "MosaicRead", "MosaicKind"]
