"""The model families trained from scratch: a model class of their own, not a GPT-2 with a memory.

A Memory Mosaic (model/mosaic/) and a MemSizer (model/memsizer/) replace GPT-2's attention (and
the Mosaic its MLP), so they have no GPT-2 weights to start from. Each is a `MemoriaGPT2Config`
subclass and a `PreTrainedModel` in Contract 2, so the launcher, the loop, the protocols and the
export treat them as every model; what differs is found here, once: which presets build one,
which settings only it reads, and its classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .memsizer import MEMSIZER_FIELDS, MEMSIZER_PRESETS, MemSizerConfig, MemSizerLMHeadModel
from .mosaic import MOSAIC_FIELDS, MOSAIC_PRESETS, MemoryMosaicConfig, MemoryMosaicLMHeadModel


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: as messages say it ("Memory Mosaic").
        presets: the presets that build it (`config.PRESETS` holds them too).
        fields: the settings only it reads (refused with another preset).
        config_class / model_class: its `MemoriaGPT2Config` subclass and its model.
    """

    name: str
    presets: frozenset[str]
    fields: frozenset[str]
    config_class: type
    model_class: type


FAMILIES = (
    Family("Memory Mosaic", MOSAIC_PRESETS, MOSAIC_FIELDS, MemoryMosaicConfig, MemoryMosaicLMHeadModel),
    Family("MemSizer", MEMSIZER_PRESETS, MEMSIZER_FIELDS, MemSizerConfig, MemSizerLMHeadModel),
)
FAMILY_PRESETS = frozenset().union(*(f.presets for f in FAMILIES))


def family_of_preset(preset: str | None) -> Family | None:
    """The family a preset builds, or None (a Memoria GPT-2, or a baseline on GPT-2)."""
    return next((f for f in FAMILIES if preset in f.presets), None)


def family_of_config(config: Any) -> Family | None:
    """The family a config (a saved model's) belongs to, or None."""
    return next((f for f in FAMILIES if isinstance(config, f.config_class)), None)


def family_of_field(name: str) -> Family | None:
    """The family that alone reads the setting `name`, or None."""
    return next((f for f in FAMILIES if name in f.fields), None)


__all__ = ["FAMILIES", "FAMILY_PRESETS", "Family", "family_of_config", "family_of_field", "family_of_preset"]
