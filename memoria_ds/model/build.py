"""Build a Memoria GPT-2 (or a baseline) from a hub name, a local directory or a config."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

from .config import MemoriaGPT2Config, resolve_preset
from .families import family_of_config, family_of_preset
from .modeling import MemoriaGPT2LMHeadModel


def build_model(
    backbone: str | os.PathLike | GPT2Config,
    preset: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    **settings: Any,
) -> Any:
    """A Memoria GPT-2 (or baseline) around any GPT-2 backbone.

    Args:
        backbone: a hub name (`"gpt2"`, `"gpt2-medium"`, `"gpt2-large"`, `"gpt2-xl"`) or a
            local directory of a GPT-2 checkpoint: its weights are loaded and the memory
            modules initialised (an exact no-op with the default `memory_init="noop"`). A
            directory saved from this class loads as it was (settings override its config).
            A `GPT2Config`: a from-scratch model with random weights.
        preset: a name from `config.PRESETS` (`"transformer"`, `"xl"`, `"memoria_wm"`,
            `"memoria_wm_stm"`, `"memoria"`, `"memoria_full_width"`, `"memoria_fast"`), or a
            preset of a family trained from scratch (`families.py`): `"memory_mosaic"` (a Memory
            Mosaic of the backbone's shape, `mosaic/`), `"memsizer"` (a MemSizer, `memsizer/`), from
            a `GPT2Config` or a directory saved from one of that family.
        dtype: parameter dtype (e.g. `torch.bfloat16`); the memory state stays fp32.
        attn_implementation: `"sdpa"` (default) or `"eager"`.
        **settings: `MemoriaGPT2Config` fields (e.g. `memoria={"num_wm": 16}`,
            `memory_layers=[0, 6]`, `xl_memory_length=150`).

    Returns:
        The model (a `MemoriaGPT2LMHeadModel`, or the family's model), in HF's mode: eval when loaded
        from a checkpoint, train when built from a config.
    """
    if isinstance(backbone, GPT2Config):
        config = build_config(backbone, preset, attn_implementation=attn_implementation, **settings)
        # from_config, not the constructor: under ZeRO-3 (an `HfDeepSpeedConfig` alive) HF then
        # partitions the weights while building and initialises them gathered
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    saved, wanted = family_of_config(AutoConfig.from_pretrained(backbone)), family_of_preset(preset)
    if saved is not wanted:
        if wanted is not None:
            raise ValueError(f"preset {preset!r} builds a {wanted.name}, which has no GPT-2 weights to start from: "
                             f"train it from scratch (model.from_scratch=true) or give a saved {wanted.name}")
        raise ValueError(f"{backbone} holds a {saved.name}: load it with preset {sorted(saved.presets)[0]!r}")
    config = build_config(backbone, preset, **settings)
    model_class = saved.model_class if saved is not None else MemoriaGPT2LMHeadModel
    extra = {} if saved is not None else {"attn_implementation": attn_implementation}
    return model_class.from_pretrained(backbone, config=config, dtype=dtype, **extra)


def build_config(backbone: str | os.PathLike | GPT2Config, preset: str | None = None,
                 **settings: Any) -> MemoriaGPT2Config:
    """The config of the model `build_model(backbone, preset, **settings)` builds, without building it or
    reading any weights (a checkpoint's memories are checked against it; a mismatch of preset and
    backbone is `build_model`'s to refuse)."""
    family = family_of_preset(preset)
    config_class = family.config_class if family is not None else MemoriaGPT2Config
    if isinstance(backbone, GPT2Config):
        return config_class.from_backbone(backbone, preset, **settings)
    saved = AutoConfig.from_pretrained(backbone)
    family = family_of_config(saved)
    if family is not None:
        return family.config_class.from_pretrained(backbone, **settings)
    if isinstance(saved, MemoriaGPT2Config):
        return MemoriaGPT2Config.from_pretrained(backbone, **resolve_preset(preset, **settings))
    return MemoriaGPT2Config.from_backbone(saved, preset, **settings)


__all__ = ["build_config", "build_model"]
