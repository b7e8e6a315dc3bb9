"""`memorizing`: the Memorizing Transformer's kNN memory (Wu et al., 2022) for an unmodified GPT-2.

One block (`MemoriaGPT2Config.memorizing_layer`) gets a kNN-augmented self-attention
(`model/knn_attention.py`): its queries also attend to the top-k (key, value) pairs of a
per-stream memory of that layer's past segments, mixed with the local attention by a
learned per-head gate. After every segment the write appends the segment's (L2-normalised
key, value) pairs of that layer to the memory (detached: no gradient flows into the
memory), keeping the newest `memorizing_size` (a FIFO, oldest out). A reset (a document
start) empties a row, as the paper clears the memory of each new document.

The paper pairs the memory with a Transformer-XL cache in every layer or uses none (it
reports both); this kind is the "no XL cache" variant: GPT-2's absolute positions give
every segment 0..L-1, and the stored keys keep the positions they were computed at.

Notation: B rows, H heads, M memory slots, L tokens of the segment, hd head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ...rows import BatchRows, rows_field
from ..knn_attention import KNNSlots
from .base import FORMAT, BlockWrites, MemoryKind, MemoryRead, check_format


@dataclass
class MemorizingMemory(BatchRows):
    """The kNN memory of one layer, per row: the newest M (key, value) pairs of its document.

    Attributes:
        keys: (B, H, M, hd) float32, L2-normalised keys (detached).
        values: (B, H, M, hd) float32 values.
        mask: (B, M) bool, True where a slot holds a token of the row's document (oldest
            first; a reset row has none).

    Memories of different M stack and exchange rows: the shorter are padded at the old end.
    """

    keys: Tensor = rows_field(pad=(2, "left"))
    values: Tensor = rows_field(pad=(2, "left"))
    mask: Tensor = rows_field(pad=(1, "left"))

    @classmethod
    def empty(cls, batch_size: int, num_heads: int, head_dim: int,
              device: torch.device | str | None = None) -> MemorizingMemory:
        shape = (batch_size, num_heads, 0, head_dim)
        return cls(torch.zeros(shape, device=device), torch.zeros(shape, device=device),
                   torch.zeros(batch_size, 0, dtype=torch.bool, device=device))

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget all rows, or the rows where the (B,) bool `mask` is True, in place (zeroed, as XL's)."""
        if mask is None:
            for t in (self.mask, self.keys, self.values):
                t.zero_()
            return
        mask = mask.to(self.mask.device, torch.bool)
        self.mask.masked_fill_(mask[:, None], False)
        rows = mask[:, None, None, None]  # (B, 1, 1, 1) over (B, H, M, hd)
        self.keys.masked_fill_(rows, 0.0)
        self.values.masked_fill_(rows, 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "memorizing", "format": FORMAT, "keys": self.keys, "values": self.values, "mask": self.mask}

    @classmethod
    def from_state_dict(
        cls, state_dict: dict[str, Any], config: Any = None, device: torch.device | str | None = None
    ) -> MemorizingMemory:
        check_format(state_dict, "memorizing")
        out = cls(state_dict["keys"], state_dict["values"], state_dict["mask"])
        if (out.keys.shape != out.values.shape or out.keys.dim() != 4 or out.keys.shape[0] != out.mask.shape[0]
                or out.keys.shape[2] != out.mask.shape[1]):
            raise ValueError(f"inconsistent memorizing memory: keys {tuple(out.keys.shape)}, "
                             f"values {tuple(out.values.shape)}, mask {tuple(out.mask.shape)}")
        return out.to(device) if device is not None else out


@dataclass
class MemorizingRead(BatchRows, MemoryRead):
    """The blocks' view of a `MemorizingMemory`: the memory layer's slots (nothing else is read).

    Attributes:
        keys / values: (B, H, M, hd) float32. mask: (B, M) bool.
    """

    keys: Tensor
    values: Tensor
    mask: Tensor
    engrams: ClassVar[None] = None
    slot_mask: ClassVar[None] = None
    collects_kv: ClassVar[bool] = True

    def knn_memory(self) -> KNNSlots:
        return KNNSlots(self.keys, self.values, self.mask)


def fifo_append(memory: Tensor, current: Tensor, size: int, dim: int) -> Tensor:
    """The newest `size` entries of [memory, current] along `dim` (fewer while not full)."""
    full = torch.cat([memory, current], dim=dim)
    return full.narrow(dim, max(0, full.shape[dim] - size), min(size, full.shape[dim]))


class MemorizingKind(MemoryKind):
    """A kNN memory of `memorizing_size` past (key, value) pairs at block `memorizing_layer`."""

    name = "memorizing"
    memory_class = MemorizingMemory

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> MemorizingMemory:
        cfg = self.config
        return MemorizingMemory.empty(batch_size, cfg.n_head, cfg.n_embd // cfg.n_head, device)

    def check(self, memory: MemorizingMemory) -> None:
        cfg = self.config
        want = (cfg.n_head, cfg.n_embd // cfg.n_head)
        if (memory.keys.shape[1], memory.keys.shape[3]) != want:
            raise ValueError(f"memorizing memory of {memory.keys.shape[1]} heads of width {memory.keys.shape[3]}; "
                             f"this model has {want[0]} of width {want[1]}")

    def read(self, memory: MemorizingMemory, dtype: torch.dtype, abstractor: Any) -> tuple[MemorizingRead, None]:
        return MemorizingRead(memory.keys, memory.values, memory.mask), None

    def frozen_read(self, memory: MemorizingMemory, dtype: torch.dtype, abstractor: Any) -> MemorizingRead:
        return self.read(memory, dtype, abstractor)[0]  # reading changes nothing; a write replaces the tensors

    def write(self, memory: MemorizingMemory, read: MemorizingRead, pending: None, writes: BlockWrites,
              hidden: Tensor, valid: Tensor) -> None:
        layer = self.config.resolved_memorizing_layer
        size = self.config.memorizing_size
        keys = F.normalize(writes.keys[layer].detach().float(), dim=-1)  # (B, H, L, hd)
        values = writes.values[layer].detach().float()
        memory.keys = fifo_append(memory.keys, keys, size, 2)  # (B, H, M, hd)
        memory.values = fifo_append(memory.values, values, size, 2)
        memory.mask = fifo_append(memory.mask, valid.to(torch.bool), size, 1)  # (B, M)
        return None


__all__ = ["MemorizingMemory", "MemorizingRead", "MemorizingKind", "fifo_append"]
