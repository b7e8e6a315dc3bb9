"""The recurrent memories a segment-level model carries, one file per kind (protocol in `base.py`).

    none     `NoMemory`       the plain backbone
    xl       `XLMemory`       Transformer-XL cached keys/values
    memoria  `MemoriaMemory`  the paper's engram memory
    memorizing  `MemorizingMemory`  the Memorizing Transformer's kNN memory of one layer

`memory_kind(config)` gives the kind a model runs; `memory_from_state_dict` rebuilds a
saved memory of any kind.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from ...memory import MemoriaConfig
from .base import FORMAT, BlockWrites, MemoryKind, MemoryRead
from .memoria import MemoriaKind, MemoriaMemory, MemoriaRead
from .memorizing import MemorizingKind, MemorizingMemory, MemorizingRead
from .none import NoMemory, NoneKind
from .xl import XLKind, XLMemory, XLRead

KINDS: dict[str, type[MemoryKind]] = {kind.name: kind for kind in (NoneKind, XLKind, MemoriaKind, MemorizingKind)}
RecurrentMemory = Union[NoMemory, XLMemory, MemoriaMemory, MemorizingMemory]


def memory_kind(config: Any) -> MemoryKind:
    """The kind of memory a model with this `MemoriaGPT2Config` runs."""
    if config.memory_type not in KINDS:
        raise ValueError(f"unknown memory_type {config.memory_type!r}; expected one of {sorted(KINDS)}")
    return KINDS[config.memory_type](config)


def memory_from_state_dict(
    state_dict: dict[str, Any], config: MemoriaConfig | None = None, device: torch.device | str | None = None
) -> RecurrentMemory:
    """Rebuild a memory of any kind from its `state_dict()` (Memoria's checked against `config`)."""
    kind = state_dict.get("kind")
    if kind not in KINDS:
        raise ValueError(f"unknown memory kind {kind!r}; expected one of {sorted(KINDS)}")
    return KINDS[kind].memory_class.from_state_dict(state_dict, config=config, device=device)


__all__ = [
    "FORMAT", "KINDS", "BlockWrites", "MemoryKind", "MemoryRead", "RecurrentMemory",
    "NoMemory", "NoneKind", "XLMemory", "XLRead", "XLKind", "MemoriaMemory", "MemoriaRead", "MemoriaKind",
    "MemorizingMemory", "MemorizingRead", "MemorizingKind", "memory_kind", "memory_from_state_dict",
]
