"""The recurrent memories a segment-level model carries, one file per kind (protocol in `base.py`).

    none     `NoMemory`       the plain backbone
    xl       `XLMemory`       Transformer-XL cached keys/values
    memoria  `MemoriaMemory`  the paper's engram memory
    compressive  `CompressiveMemory`  the Compressive Transformer (xl + compressed memory)
    infinity     `InfinityMemory`     the infinity-former (continuous long-term memory)
    memorizing   `MemorizingMemory`  the Memorizing Transformer's kNN memory of one layer
    mosaic       `MosaicMemory`       a Memory Mosaic's contextual memory carried across segments
    memsizer     `MemSizerMemory`     a MemSizer's key-value memories (k slots per layer) carried across segments
    memformer    `MemformerMemory`    Memformer's memory slots, read by every block, written by slot attention

`memory_kind(config)` gives the kind a model runs; `memory_from_state_dict` rebuilds a
saved memory of any kind, after its kind's `check_state` (built from `saved_state.py`).
"""

from __future__ import annotations

from typing import Any, Union

import torch

from ...memory import MemoriaConfig
from ...rows import BatchRows
from ..composition import is_composite, memory_kinds
from .base import FORMAT, BlockWrites, MemoryKind, MemoryRead, at_fixed_addresses
from .composite import CompositeKind, CompositeMemory, CompositeRead, check_composite_state
from .compressive import CompressiveKind, CompressiveMemory, CompressiveRead, CompressiveSettings
from .infinity import InfinityKind, InfinityMemory, InfinityRead, InfinitySettings
from .memformer import MemformerKind, MemformerMemory, MemformerRead, MemformerSettings
from .memoria import MemoriaKind, MemoriaMemory, MemoriaRead
from .memorizing import MemorizingKind, MemorizingMemory, MemorizingRead
from .memsizer import MemSizerKind, MemSizerMemory, MemSizerRead
from .mosaic import MosaicKind, MosaicMemory, MosaicRead
from .none import NoMemory, NoneKind
from .xl import XLKind, XLMemory, XLRead

ENCODER_KIND = "memoria_encoder"  # a Memoria encoder's saved memory (`model/encoder/memory.py`'s KIND)

KINDS: dict[str, type[MemoryKind]] = {kind.name: kind for kind in (NoneKind, XLKind, MemoriaKind, CompressiveKind,
                                                                  InfinityKind, MemorizingKind, MosaicKind,
                                                                  MemformerKind, MemSizerKind)}
RecurrentMemory = Union[NoMemory, XLMemory, MemoriaMemory, CompressiveMemory, InfinityMemory, MemorizingMemory,
                        MosaicMemory, MemformerMemory, MemSizerMemory]


def memory_kind(config: Any) -> MemoryKind:
    """The kind of memory a model with this `MemoriaGPT2Config` runs (a composite's: `CompositeKind`)."""
    if is_composite(config.memory_type):
        return CompositeKind(config, KINDS)
    if config.memory_type not in KINDS:
        raise ValueError(f"unknown memory_type {config.memory_type!r}; expected one of {sorted(KINDS)}")
    return KINDS[config.memory_type](config)


def _model_kind(model_config: Any) -> str | None:
    """The memory kind a model of `model_config` runs: a GPT-2 config's `memory_type`; an encoder's
    `memoria_encoder`, or `none` without a memory (preset `backbone`; HF's own classifiers, whose configs
    have no `use_memory`: Longformer, BigBird, GPT-2); None without a config."""
    if model_config is None:
        return None
    if hasattr(model_config, "memory_type"):
        return model_config.memory_type
    return ENCODER_KIND if getattr(model_config, "use_memory", False) else "none"


def memory_from_state_dict(
    state_dict: dict[str, Any], config: MemoriaConfig | None = None, device: torch.device | str | None = None,
    model_config: Any = None,
) -> RecurrentMemory:
    """Rebuild a memory of any kind from its `state_dict()`.

    A saved memory comes from a file (a checkpoint shard, a snapshot): whatever is wrong with it
    (a missing or mistyped field, a non-finite value, a value its kind cannot hold, with
    `model_config` a memory of another kind or of a shape this model cannot run) is a ValueError
    naming the problem, never another exception from inside a kind, nor later in a forward.
    Every kind checks its own fields (`MemoryKind.check_state`) before the memory is rebuilt. The
    memory holds copies of the saved tensors (it is written in place: `BatchRows.store_`).

    Args:
        config: Memoria's settings to check an engine state's capacity against (implied by `model_config`).
        model_config: the config of the model that will run the memory (a `MemoriaGPT2Config`):
            the memory must be of its kind and fit its shapes and settings.
    """
    if not isinstance(state_dict, dict):
        raise ValueError(f"a saved memory must be a mapping, got a {type(state_dict).__name__}")
    kind = state_dict.get("kind")
    wanted = _model_kind(model_config)
    if kind == ENCODER_KIND and wanted in (None, ENCODER_KIND):  # a Memoria encoder's: the engine's state alone
        return _encoder_memory(state_dict, config, device, model_config)
    if not isinstance(kind, str) or (kind != ENCODER_KIND and any(k not in KINDS for k in memory_kinds(kind))):
        raise ValueError(f"unknown memory kind {kind!r}; expected one of {sorted(KINDS)}, or several joined by '+'")
    if wanted is not None and kind != wanted:
        raise ValueError(f"saved memory is of kind {kind!r} but this model's memory is {wanted!r}")
    if not hasattr(model_config, "memory_type"):  # an encoder without a memory (`backbone`): no GPT-2 config
        model_config = None
    where = _non_finite(state_dict)
    if where is not None:
        raise ValueError(f"saved {kind} memory holds non-finite values in `{where}`: damaged or crafted, not loaded")
    if model_config is not None and "memoria" in memory_kinds(kind) and config is None:
        config = model_config.memoria_config
    try:
        if is_composite(kind):
            check_composite_state(state_dict, KINDS, model_config)
            memory_class = CompositeMemory.of(memory_kinds(kind), KINDS)
        else:
            KINDS[kind].check_state(state_dict, model_config)
            memory_class = KINDS[kind].memory_class
        memory = memory_class.from_state_dict(state_dict, config=config, device=device)
        # its own tensors: a memory is written in place, and one sharing a live memory's tensors (its
        # `state_dict()`'s) would write into that one too
        return at_fixed_addresses(memory.clone() if isinstance(memory, BatchRows) else memory)
    except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
        raise ValueError(f"saved {kind} memory is malformed ({type(e).__name__}: {e})") from None


def _encoder_memory(state_dict: dict[str, Any], config: MemoriaConfig | None, device: torch.device | str | None,
                    model_config: Any) -> RecurrentMemory:
    """A Memoria encoder's saved memory, checked as every kind's is (`memory_from_state_dict`)."""
    from ..encoder.config import EncoderMemoryFields
    from ..encoder.memory import EncoderMemory

    if model_config is not None and not isinstance(model_config, EncoderMemoryFields):
        raise ValueError(f"saved memory is of kind {ENCODER_KIND!r} (a Memoria encoder's) but this model's memory "
                         f"is {getattr(model_config, 'memory_type', None)!r}")
    where = _non_finite(state_dict)
    if where is not None:
        raise ValueError(f"saved {ENCODER_KIND} memory holds non-finite values in `{where}`: damaged or crafted, "
                         f"not loaded")
    if config is None and model_config is not None:
        config = model_config.memoria_config
    try:
        memory = EncoderMemory.from_state_dict(state_dict, config=config, device=device)
    except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
        raise ValueError(f"saved {ENCODER_KIND} memory is malformed ({type(e).__name__}: {e})") from None
    if model_config is not None and memory.state.vectors.shape[-1] != model_config.hidden_size:
        raise ValueError(f"saved {ENCODER_KIND} memory holds engrams of width {memory.state.vectors.shape[-1]}, "
                         f"this model's are {model_config.hidden_size}")
    return memory


def _non_finite(tree: Any, name: str = "") -> str | None:
    """The name of the first floating-point tensor in `tree` with a NaN or infinity, else None."""
    if isinstance(tree, torch.Tensor):
        return name if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        found = _non_finite(value, f"{name}.{key}" if name else str(key))
        if found is not None:
            return found
    return None


__all__ = [
    "FORMAT", "KINDS", "at_fixed_addresses", "BlockWrites", "MemoryKind", "MemoryRead", "RecurrentMemory",
    "NoMemory", "NoneKind", "XLMemory", "XLRead", "XLKind", "MemoriaMemory", "MemoriaRead", "MemoriaKind",
    "CompressiveMemory", "CompressiveRead", "CompressiveKind", "CompressiveSettings",
    "InfinityMemory", "InfinityRead", "InfinityKind", "InfinitySettings",
    "MemorizingMemory", "MemorizingRead", "MemorizingKind", "MosaicMemory", "MosaicRead", "MosaicKind",
    "MemformerMemory", "MemformerRead", "MemformerKind", "MemformerSettings",
    "MemSizerMemory", "MemSizerRead", "MemSizerKind",
    "CompositeKind", "CompositeMemory", "CompositeRead",
    "memory_kind", "memory_from_state_dict",
]
