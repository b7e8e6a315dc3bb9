"""`memsizer`: a MemSizer's key-value memories carried across segments.

MemSizer's attention is a recurrence (model/memsizer/attention.py): each layer's memory
S_t = S_{t-1} + k_t v_t^T (k slots by D) and the stream's length t are all that a token reads
of its past. This kind keeps both per stream row, so the next segment continues them:

- `sums`: S of every layer after the segment's last real token, fp32 whatever the model's dtype
  (a sum over the whole stream, which bf16 would round away; fp64 for a float64 model, as the
  tests run one); detached, as Transformer-XL caches keys/values;
- `tokens`: t, the real tokens the row has read since its reset (it scales the read,
  1 / sqrt(t), and places the next segment's positions).

A stream read segment by segment then gives the logits of the stream read at once
(tests/model/test_memsizer_carry.py), for any segment length, one token at a time included
(the reference's `incremental_revatt`). The state does not grow with the stream.

Notation: B rows, Y blocks, K slots, D width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...rows import BatchRows
from ..composition import OWN_MODEL
from .base import FORMAT, MemoryKind, MemoryRead, check_format
from .read_copy import held
from .saved_state import INT64, SavedState

STATE_DTYPES = (torch.float32, torch.float64)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The memory's dtype for a model of `dtype`: fp32, or fp64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class MemSizerMemory(BatchRows):
    """Every layer's key-value memory and the stream's length, per row.

    Attributes:
        sums: (B, Y, K, D) fp32 (fp64 for a float64 model), S = sum_t k_t v_t^T of each layer over the
            row's stream so far.
        tokens: (B,) int64, t: the real tokens read since the row's reset.
    """

    sums: Tensor
    tokens: Tensor

    @classmethod
    def empty(cls, batch_size: int, num_layers: int, slots: int, width: int,
              device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> MemSizerMemory:
        """A fresh memory: S = 0, t = 0 for every row."""
        return cls(sums=torch.zeros(batch_size, num_layers, slots, width, device=device, dtype=dtype),
                   tokens=torch.zeros(batch_size, dtype=torch.long, device=device))

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget all rows, or those where the (B,) bool `mask` is True, in place (zeroed: a row left
        non-finite by a diverged step reads as a fresh one)."""
        if mask is None:
            self.sums.zero_()
            self.tokens.zero_()
            return
        mask = mask.to(self.tokens.device, torch.bool)
        self.sums.masked_fill_(mask.view(-1, 1, 1, 1), 0.0)
        self.tokens.masked_fill_(mask, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "memsizer", "format": FORMAT, "sums": self.sums, "tokens": self.tokens}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], config: Any = None,
                        device: torch.device | str | None = None) -> MemSizerMemory:
        check_format(state_dict, "memsizer")
        out = cls(sums=state_dict["sums"], tokens=state_dict["tokens"])
        if out.tokens.shape != out.sums.shape[:1]:
            raise ValueError(f"inconsistent memsizer memory: sums {tuple(out.sums.shape)}, tokens "
                             f"{tuple(out.tokens.shape)} (expected ({out.sums.shape[0]},))")
        return out.to(device) if device is not None else out


@dataclass
class MemSizerRead(MemoryRead):
    """The blocks' view of a `MemSizerMemory` (a held copy: the write overwrites the memory)."""

    memory: MemSizerMemory
    engrams: ClassVar[None] = None
    slot_mask: ClassVar[None] = None

    @property
    def tokens(self) -> Tensor:
        """(B,) int64 t before this segment."""
        return self.memory.tokens

    def layer(self, i: int) -> Tensor:
        """(B, K, D) layer i's memory before this segment (fp32)."""
        return self.memory.sums[:, i]


class MemSizerKind(MemoryKind):
    """Carries each layer's MemSizer memory S and the stream's length t."""

    name = "memsizer"
    memory_class = MemSizerMemory
    places = frozenset({OWN_MODEL})  # the MemSizer's own model: composes with nothing

    def _shape(self) -> tuple[int, int, int]:
        cfg = self.config
        return cfg.n_layer, cfg.memsizer_slots, cfg.n_embd

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> MemSizerMemory:
        return MemSizerMemory.empty(batch_size, *self._shape(), device, state_dtype(dtype))

    def row_bytes(self, segment_length: int) -> dict[str, int]:
        Y, K, D = self._shape()
        return {"sums": Y * K * D * 4, "tokens": 8}

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: Any = None) -> None:
        sizes = {} if config is None else {"Y": config.n_layer, "K": config.memsizer_slots, "D": config.n_embd}
        s = SavedState(state_dict, "memsizer", sizes)
        sums = s.tensor("sums", STATE_DTYPES, "B Y K D")
        tokens = s.tensor("tokens", INT64, "B")
        s.require((tokens >= 0).all(), "tokens", "holds a negative count")
        # a row that has read nothing holds nothing (else its first token would read the crafted sums)
        holds = sums.flatten(1).ne(0).any(1)  # (B,)
        s.require(((tokens > 0) | ~holds).all(), "sums", "holds values in a row that has read no token (tokens 0)")

    def check(self, memory: MemSizerMemory) -> None:
        got = tuple(memory.sums.shape[1:])
        if got != self._shape():
            raise ValueError(f"memsizer memory of {got} (blocks, slots, width) for a model of {self._shape()}")

    def read(self, memory: MemSizerMemory, dtype: torch.dtype, abstractor: Any) -> tuple[MemSizerRead, None]:
        return MemSizerRead(held(memory)), None  # the write overwrites the memory in place: the backward reads a copy

    def frozen_read(self, memory: MemSizerMemory, dtype: torch.dtype, abstractor: Any) -> MemSizerRead:
        return self.read(memory, dtype, abstractor)[0]  # the read holds copies (`read_copy.held`)

    def write(self, memory: MemSizerMemory, read: MemSizerRead, pending: None, writes: list[Tensor],
              hidden: Tensor, valid: Tensor) -> None:
        """Keep each layer's memory after the segment (`writes`: per block, (B, K, D) in the memory's dtype)
        and t plus the segment's real tokens."""
        memory.store_(sums=torch.stack(writes, 1), tokens=read.tokens + valid.sum(1))  # in place (`store_`)
        return None


__all__ = ["MemSizerMemory", "MemSizerRead", "MemSizerKind"]
