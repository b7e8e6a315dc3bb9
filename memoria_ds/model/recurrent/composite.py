"""Several memory kinds in one model (`memory_type="xl+memoria"`; which compose: `model/composition.py`).

One forward is still one memory step, the protocol's (`base.py`), with every part doing its own:

    memory.<kind> = part.prepare(memory.<kind>, ...)      for each part, in order
    read = CompositeRead({kind: part.read(...)})          each read where it reads: the cached
                                                          slots, the engrams, a side or a block's own attention
    hidden = blocks(...)                                  one pass, every part read in it
    part.write(memory.<kind>, read.parts[kind], ...)      for each part, the same `BlockWrites`

The memory is a dataclass of the parts' memories, one field per kind (`CompositeMemory.of`), so
the row operations (`BatchRows`: take, put, cat, move, detach) apply to every part; a reset
resets every part, `reset_part` one (the memory gain of each part). Its `state_dict` holds the
parts' under `parts`; each part is checked by its own kind's `check_state` against the part's
view of the model's config (`part_config`: that kind's `memory_type` and `memory_settings`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ...rows import BatchRows
from ..composition import memory_kinds, part_settings
from .base import FORMAT, BlockWrites, MemoryKind, MemoryRead, check_format


def part_config(config: Any, kind: str) -> Any:
    """`config` as part `kind` of a composite sees it: its `memory_type` and its `memory_settings`."""
    view = copy.copy(config)
    view.__dict__["memory_type"] = kind
    view.__dict__["memory_settings"] = part_settings(config.memory_type, config.memory_settings, kind)
    return view


class CompositeMemory(BatchRows):
    """The memories of a composite's parts, one field per kind (a dataclass made by `of`)."""

    kinds: ClassVar[tuple[str, ...]] = ()
    part_classes: ClassVar[dict[str, type]] = {}  # each part's memory class, by kind

    @staticmethod
    def of(kinds: tuple[str, ...], registry: dict[str, type[MemoryKind]]) -> type[CompositeMemory]:
        """The memory class of the composite of `kinds` (made once per combination), its parts' kinds
        from `registry` (`recurrent.KINDS`)."""
        return _memory_class(kinds, tuple(registry[k].memory_class for k in kinds))

    @property
    def name(self) -> str:
        return "+".join(self.kinds)

    def parts(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.kinds}

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget all rows, or those where the (B,) bool `mask` is True, in every part."""
        for part in self.parts().values():
            part.reset(mask)

    def reset_part(self, kind: str, mask: Tensor | None = None) -> None:
        """Forget rows of one part only (the memory gain of that part)."""
        if kind not in self.kinds:
            raise ValueError(f"{self.name} memory has no part {kind!r}; its parts: {list(self.kinds)}")
        getattr(self, kind).reset(mask)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.name, "format": FORMAT, "parts": {k: m.state_dict() for k, m in self.parts().items()}}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], config: Any = None,
                        device: torch.device | str | None = None) -> CompositeMemory:
        """Rebuild a saved composite memory (its parts by their own kinds); `config`: Memoria's settings."""
        check_format(state_dict, "+".join(cls.kinds))
        parts = state_dict.get("parts")
        if not isinstance(parts, dict) or sorted(parts) != sorted(cls.kinds):
            raise ValueError(f"saved {'+'.join(cls.kinds)} memory: `parts` must hold {list(cls.kinds)}, got "
                             f"{sorted(parts) if isinstance(parts, dict) else type(parts).__name__}")
        return cls(**{k: cls.part_classes[k].from_state_dict(parts[k], config=config if k == "memoria" else None,
                                                              device=device) for k in cls.kinds})


@functools.cache
def _memory_class(kinds: tuple[str, ...], classes: tuple[type, ...]) -> type[CompositeMemory]:
    cls = dataclasses.make_dataclass("CompositeMemory_" + "_".join(kinds), [(k, Any) for k in kinds],
                                     bases=(CompositeMemory,))
    cls.kinds, cls.part_classes = kinds, dict(zip(kinds, classes))
    return cls


class CompositeRead(MemoryRead):
    """The parts' reads side by side; each place of a block is read by the one part that reads there
    (`composition.check_composition` allows no two), the positions by the part that moves them."""

    def __init__(self, parts: dict[str, MemoryRead]) -> None:
        self.parts = parts
        reads = list(parts.values())

        def one(attr: str) -> Any:
            return next((getattr(r, attr) for r in reads if getattr(r, attr, None) is not None), None)

        self.engrams = one("engrams")
        # the self-attention's slots: engram slots first (Memoria read as self-attention), then a cache
        masks = [r.slot_mask for r in sorted(reads, key=lambda r: not r.engram_slots) if r.slot_mask is not None]
        self.slot_mask = torch.cat(masks, dim=1) if len(masks) > 1 else masks[0] if masks else None
        self.collects_kv = any(r.collects_kv for r in reads)
        self.collects_queries = any(r.collects_queries for r in reads)
        self.engram_slots = any(r.engram_slots for r in reads)
        self.has_side = any(r.has_side for r in reads)
        self.replaces_attention = any(r.replaces_attention for r in reads)

    def _one(self, flag: str) -> MemoryRead:
        return next(r for r in self.parts.values() if getattr(r, flag))

    def positions(self, positions: Tensor) -> Tensor:
        for read in self.parts.values():
            positions = read.positions(positions)
        return positions

    def layer_kv(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        for read in self.parts.values():
            kv = read.layer_kv(layer)
            if kv[0] is not None:
                return kv
        return None, None

    def memory_inputs(self, query_mask: Tensor | None, use_sdpa: bool) -> Any:
        for read in self.parts.values():
            inputs = read.memory_inputs(query_mask, use_sdpa)
            if inputs is not None:
                return inputs
        return None

    def side_attention(self, layer: int, hidden: Tensor, queries: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        return self._one("has_side").side_attention(layer, hidden, queries)

    def block_attention(self, layer: int, attn: Any, hidden: Tensor, attention_mask: Tensor | None,
                        kv: Any) -> Tensor | None:
        return self._one("replaces_attention").block_attention(layer, attn, hidden, attention_mask, kv)

    def take_rows(self, rows: Tensor | list[int]) -> CompositeRead:
        return CompositeRead({k: r.take_rows(rows) for k, r in self.parts.items()})


class CompositeKind(MemoryKind):
    """The kinds of `config.memory_type` (`"xl+memoria"`) run side by side (`composition.py`).

    Each part is its kind (from `registry`, `recurrent.KINDS`), built on its view of the config
    (`part_config`); the composite's module is the one part's that brings one (at most one does).
    """

    name = "composite"
    memory_class = CompositeMemory

    def __init__(self, config: Any, registry: dict[str, type[MemoryKind]]) -> None:
        self.name = config.memory_type
        self.kinds = memory_kinds(config.memory_type)
        self.parts = {k: registry[k](part_config(config, k)) for k in self.kinds}
        self.memory_class = CompositeMemory.of(self.kinds, registry)
        self.carries_state = any(p.carries_state for p in self.parts.values())
        self.trains_across_segments = any(p.trains_across_segments for p in self.parts.values())
        super().__init__(config)

    def _parse(self) -> tuple[dict[str, Any], Any]:
        return dict(self.config.memory_settings or {}), None  # each part parses its own

    def build_module(self) -> nn.Module | None:
        modules = [m for m in (p.build_module() for p in self.parts.values()) if m is not None]
        return modules[0] if modules else None  # at most one part has modules (composition.PLACES)

    def cached_slots(self, segment_length: int) -> int:
        return sum(p.cached_slots(segment_length) for p in self.parts.values())

    def row_bytes(self, segment_length: int) -> dict[str, int]:
        return {f"{k}.{name}": n for k, p in self.parts.items() for name, n in p.row_bytes(segment_length).items()}

    def auxiliary_loss(self, pending: dict[str, Any]) -> Tensor | None:
        total = None
        for k, p in self.parts.items():
            loss = p.auxiliary_loss(pending[k])
            if loss is not None:
                total = loss if total is None else total + loss
        return total

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> CompositeMemory:
        return self.memory_class(**{k: p.empty(batch_size, device, dtype) for k, p in self.parts.items()})

    def check(self, memory: CompositeMemory) -> None:
        for k, p in self.parts.items():
            p.check(getattr(memory, k))

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: Any = None) -> None:
        raise NotImplementedError("a composite's parts are checked by `check_composite_state`")

    def prepare(self, memory: CompositeMemory | None, batch_size: int, device: torch.device, dtype: torch.dtype,
                reset: Tensor | None) -> CompositeMemory:
        if memory is not None and not isinstance(memory, self.memory_class):
            raise TypeError(f"a `{self.name}` model takes a {self.memory_class.__name__}, got {type(memory).__name__}")
        parts = {k: p.prepare(None if memory is None else getattr(memory, k), batch_size, device, dtype, reset)
                 for k, p in self.parts.items()}
        if memory is None:
            return self.memory_class(**parts)
        for k, part in parts.items():  # the same objects, unless a part made itself anew (a padded length)
            setattr(memory, k, part)
        return memory

    def read(self, memory: CompositeMemory, dtype: torch.dtype, module: nn.Module | None
             ) -> tuple[CompositeRead, dict[str, Any]]:
        reads, pending = {}, {}
        for k, p in self.parts.items():
            reads[k], pending[k] = p.read(getattr(memory, k), dtype, module)
        return CompositeRead(reads), pending

    def frozen_read(self, memory: CompositeMemory, dtype: torch.dtype, module: nn.Module | None) -> CompositeRead:
        return CompositeRead({k: p.frozen_read(getattr(memory, k), dtype, module) for k, p in self.parts.items()})

    def write(self, memory: CompositeMemory, read: CompositeRead, pending: dict[str, Any], writes: BlockWrites,
              hidden: Tensor, valid: Tensor) -> Any:
        """Every part writes its own memory from the same blocks' writes; the stats are the part's that has
        any (Memoria's engine)."""
        stats = None
        for k, p in self.parts.items():
            got = p.write(getattr(memory, k), read.parts[k], pending[k], writes, hidden, valid)
            stats = got if got is not None else stats
        return stats


def check_composite_state(state_dict: Any, registry: dict[str, type[MemoryKind]], config: Any = None) -> None:
    """Raise ValueError unless `state_dict` is a saved composite memory whose every part its kind (in
    `registry`, `recurrent.KINDS`) accepts."""
    kind = state_dict.get("kind") if isinstance(state_dict, dict) else None
    kinds = memory_kinds(kind) if isinstance(kind, str) else ()
    check_format(state_dict, "+".join(kinds))
    parts = state_dict.get("parts")
    if not isinstance(parts, dict) or sorted(parts) != sorted(kinds):
        raise ValueError(f"saved {kind} memory: `parts` must hold {list(kinds)}")
    for k in kinds:
        try:
            registry[k].check_state(parts[k], None if config is None else part_config(config, k))
        except ValueError as e:
            raise ValueError(f"saved {kind} memory, part {k!r}: {e}") from None


__all__ = ["CompositeKind", "CompositeMemory", "CompositeRead", "check_composite_state", "part_config"]
