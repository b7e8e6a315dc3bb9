"""`none`: the plain backbone. Nothing crosses segments; the memory only keeps the batch size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .base import FORMAT, EmptyRead, MemoryKind, check_format
from .saved_state import SavedState


@dataclass
class NoMemory:
    """The `none` model's memory: the batch size and nothing else (same methods as the others)."""

    batch_size: int

    @classmethod
    def empty(cls, batch_size: int) -> NoMemory:
        return cls(batch_size)

    @property
    def device(self) -> None:
        return None

    def reset(self, mask: Tensor | None = None) -> None:
        return None

    def detach_(self) -> NoMemory:
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "none", "format": FORMAT, "batch_size": self.batch_size}

    @classmethod
    def from_state_dict(
        cls, state_dict: dict[str, Any], config: Any = None, device: torch.device | str | None = None
    ) -> NoMemory:
        check_format(state_dict, "none")
        return cls(int(state_dict["batch_size"]))

    def take_rows(self, rows: Tensor | list[int]) -> NoMemory:
        return NoMemory(len(rows))

    def put_rows(self, rows: Tensor | list[int], other: NoMemory) -> None:
        if len(rows) != other.batch_size:
            raise ValueError(f"{len(rows)} row indices for a source of {other.batch_size} rows")

    def to(self, device: torch.device | str) -> NoMemory:
        return self

    def clone(self) -> NoMemory:
        return NoMemory(self.batch_size)

    @staticmethod
    def cat(memories: list[NoMemory]) -> NoMemory:
        return NoMemory(sum(m.batch_size for m in memories))


class NoneKind(MemoryKind):
    """Reads nothing, writes nothing."""

    name = "none"
    places = frozenset()
    memory_class = NoMemory
    carries_state = False

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> NoMemory:
        return NoMemory(batch_size)

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: Any = None) -> None:
        s = SavedState(state_dict, "none")
        rows = state_dict.get("batch_size")
        s.require(type(rows) is int and rows >= 0, "batch_size", f"is {rows!r}, expected a number of rows >= 0")

    def read(self, memory: NoMemory, dtype: torch.dtype, abstractor: Any) -> tuple[EmptyRead, None]:
        return EmptyRead(), None

    def write(self, memory: NoMemory, read: EmptyRead, pending: Any, writes: Any, hidden: Tensor, valid: Tensor):
        return None


__all__ = ["NoMemory", "NoneKind"]
