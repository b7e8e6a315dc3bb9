"""GPU memory per rank of a run, estimated from its configuration without building it.

Parts, per data-parallel rank (Psi = parameters, Nd = ranks):

- **Model states**: DeepSpeed's own estimators (`estimate_zero2/3_model_states_mem_needs`,
  called through `train.engine.zero_model_state_bytes`): 16-bit weights 2 bytes per
  parameter, 16- and 32-bit gradients, fp32 master weights and Adam moments 18 bytes per
  parameter over the ranks; ZeRO-3 also holds its largest layer whole; `offload` moves the
  optimizer part (and for ZeRO-3 the weights) to CPU memory, reported beside. ZeRO-1, which
  has no estimator in DeepSpeed, is counted the same way with only the fp32 part
  partitioned. The parameter counts come from the real model class built on the `meta`
  device.
- **Engram state** (exact, from `MemoryState`'s fields): per memory row, vectors C x D
  fp32, the co-retrieval counts C x C (int16 by default), plus per-slot kind / lifespan /
  uid / norm, and the previous segment's hidden states L x D fp32; times the rows (=
  streams) of the rank. Transformer-XL instead keeps keys and values of every layer.
- **Activations** (rough; `train/activation_memory.py`, by which `train/preflight.py` also
  refuses a bptt span that cannot fit): Korthikanti et al. (2022), s*b*h*(34 + 5*a*k/h) bytes per
  layer in 16-bit without recomputation (k = keys attended), plus the logits and their
  fp32 log-softmax, plus the memory cross-attention of Memoria blocks. Good to about 30%.

Nothing here counts the CUDA context, allocator fragmentation or DeepSpeed's buffers:
keep a margin (the planner asks for 15%).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from ..model import MemoriaGPT2Config
from ..train.activation_memory import (GIB, activation_bytes, engram_bytes_per_row, fmt_bytes, span_bytes,
                                       vocab_size)
from ..train.build import from_scratch_backbone
from ..train.config import RunConfig
from ..train.engine import zero_model_state_bytes
from .zero_choices import SINGLE_GPU_CONFIG, ZERO_CHOICES, Footprint

def model_config(cfg: RunConfig) -> MemoriaGPT2Config:
    """The model configuration `build_run_model` would build, from the names alone (no download).

    A GPT-2 hub name gives its published shape (`train.build.GPT2_SHAPES`); a local
    directory its config.json; a from-scratch model the corpus vocabulary. A classifier's
    (`model.task: classification`) is its encoder's (`encoder_estimates.encoder_model_config`).
    """
    if cfg.model.task == "classification":
        from .encoder_estimates import encoder_model_config

        return encoder_model_config(cfg)
    m = cfg.model
    settings: dict[str, Any] = dict(m.settings)
    settings.setdefault("segment_length", cfg.data.segment_length)
    vocab = settings.pop("vocab_size", vocab_size(cfg)) if m.from_scratch else None
    backbone = from_scratch_backbone(m, vocab)  # the backbone's architecture, as the training resolves it
    return MemoriaGPT2Config.from_backbone(backbone, m.preset, attn_implementation=m.attn_implementation, **settings)


def count_parameters(config: MemoriaGPT2Config) -> dict[str, int]:
    """Parameters of the model (tied embeddings once), split into backbone and memory modules.

    Built on the `meta` device (no memory, no initialisation cost worth the name); cached per config.
    """
    return dict(_count_parameters(config.to_json_string()))


@functools.lru_cache(maxsize=256)
def _count_parameters(config_json: str) -> tuple[tuple[str, int], ...]:
    from ..model import MemoriaGPT2LMHeadModel

    config = MemoriaGPT2Config.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = MemoriaGPT2LMHeadModel(config)
    total = sum(p.numel() for p in model.parameters())
    backbone = sum(p.numel() for p in model.transformer.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())  # ZeRO-3 gathers it
    return (("total", total), ("backbone", backbone), ("memory", total - backbone), ("largest_layer", largest))


def estimate(cfg: RunConfig, world_size: int, zero: str, config: MemoriaGPT2Config | None = None) -> Footprint:
    """The footprint of `cfg` on `world_size` ranks under ZeRO choice `zero` (`ZERO_CHOICES` key)."""
    config = config or model_config(cfg)
    if cfg.model.task == "classification":
        from .encoder_estimates import footprint

        return footprint(cfg, world_size, zero, config)
    params = count_parameters(config)
    stage, offload, _ = ZERO_CHOICES[zero]
    states = zero_model_state_bytes(params["total"], params["largest_layer"], stage, offload,
                                    gpus_per_node=max(world_size, 1))
    acts = activation_bytes(config, cfg.optim.micro_batch_size, cfg.data.segment_length)
    return Footprint(params=params, zero=zero, model_states=states, activations=acts,
                     rows_per_rank=cfg.optim.micro_batch_size * cfg.optim.grad_accum,
                     engram_row=engram_bytes_per_row(config, cfg.data.segment_length))


def choose_zero(cfg: RunConfig, world_size: int, gpu_memory_gib: float, margin: float = 0.15,
                config: MemoriaGPT2Config | None = None) -> Footprint:
    """The cheapest ZeRO choice whose estimate fits `gpu_memory_gib` with `margin` to spare.

    Raises:
        ValueError: nothing fits (the message gives the smallest estimate).
    """
    config = config or model_config(cfg)
    best = None
    for zero in ZERO_CHOICES:
        fp = estimate(cfg, world_size, zero, config)
        if fp.total <= (1 - margin) * gpu_memory_gib * GIB:
            return fp
        best = fp if best is None or fp.total < best.total else best
    raise ValueError(
        f"no ZeRO choice fits {gpu_memory_gib:g} GiB per GPU: the smallest estimate is {best.total / GIB:.1f} GiB "
        f"({best.zero}); use more GPUs, a smaller micro-batch (--micro-batch) or gradient checkpointing"
    )


def ds_config_for(zero: str, world_size: int) -> str:
    """The DeepSpeed JSON of a ZeRO choice (one rank: single_gpu.json unless offloading)."""
    stage, offload, path = ZERO_CHOICES[zero]
    return SINGLE_GPU_CONFIG if world_size == 1 and not offload and stage < 3 else path


__all__ = ["Footprint", "ZERO_CHOICES", "activation_bytes", "choose_zero", "count_parameters", "ds_config_for",
           "engram_bytes_per_row", "estimate", "fmt_bytes", "model_config", "span_bytes", "vocab_size"]
