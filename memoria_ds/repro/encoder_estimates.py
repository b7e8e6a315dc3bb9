"""The planner's estimates for a classifier run (`model.task: classification`): model, memory, steps, cost.

The same quantities `footprint.py` and `cost.py` give a language model, for an encoder classifier
(Memoria BERT / RoBERTa, or BERT, RoBERTa, Longformer, BigBird read without memory) on labelled
documents, from the names alone (no download):

- **Model**: a hub name of `PUBLISHED_ENCODERS` gives its published shape (12-layer base models);
  a local directory its config.json. Parameters are counted on the `meta` device from the model
  class the run builds; the memory modules apart.
- **Activations** per micro-batch and segment, Korthikanti et al. (2022) as `footprint.py`:
  s*b*h*(34 + 5*a*k/h) bytes per layer, k the keys a token attends: the whole segment (BERT,
  RoBERTa), the sliding window and the global token (Longformer), the window, global and random
  blocks (BigBird); Memoria's layers above `memory_layer_index` add their memory attention over
  N_wm + K_stm + K_ltm engrams. A run stepping once per K segments keeps K segments' activations.
- **Engram state** per document row: the engine's `MemoryState` (C x D fp32 vectors, C x C counts,
  per-slot fields); no carried segment (an encoder's working memory is its current segment).
- **Steps**: ceil(documents / batch) batches per epoch (the last one padded, as the loop reads it),
  K segments each, one optimiser step per `optim.bptt_segments`. The evaluation reads the
  evaluated split and every `eval_splits` split once per protocol.
- **Time**: `cost.py`'s constants and method (A100 bf16 peak x MFU 0.35, per-block latency, 6 ms per
  memory step), per segment; FLOPs per token 6 x parameters + 12 x layers x D x keys (+ Memoria's
  cross-attention). Good to a factor of about 2.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, BertConfig, BigBirdConfig, LongformerConfig, PretrainedConfig, RobertaConfig

from ..model.encoder.config import EncoderMemoryFields, encoder_config
from ..model.encoder.plain import PLAIN_CLASSIFIERS, is_plain_classifier, plain_classifier_config
from ..train.activation_memory import engram_row_bytes
from ..train.config import RunConfig
from ..train.engine import zero_model_state_bytes
from . import cost
from .zero_choices import ZERO_CHOICES, Footprint

# Published shapes of the Table 3 backbones (their hub config.json files), for a dry run without network
PUBLISHED_ENCODERS: dict[str, PretrainedConfig] = {
    "bert-base-uncased": BertConfig(vocab_size=30522),
    "roberta-base": RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                                  bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5),
    "allenai/longformer-base-4096": LongformerConfig(vocab_size=50265, max_position_embeddings=4098, type_vocab_size=1,
                                                     attention_window=[512] * 12, pad_token_id=1, layer_norm_eps=1e-5),
    "google/bigbird-roberta-base": BigBirdConfig(vocab_size=50358, max_position_embeddings=4096, block_size=64,
                                                 num_random_blocks=3, attention_type="block_sparse"),
}
CLASSES = 2  # a dry run's head when the documents are not read (Hyperpartisan's)


def backbone_config(name: str) -> PretrainedConfig:
    """The backbone's config: a published shape, else a local directory's (or the hub's, if reachable)."""
    if name in PUBLISHED_ENCODERS:
        return PUBLISHED_ENCODERS[name]
    return AutoConfig.from_pretrained(name)


def encoder_model_config(cfg: RunConfig) -> PretrainedConfig:
    """The config of the classifier `cfg` trains, from the names alone (a head of `CLASSES` classes
    unless `model.settings.num_labels` says)."""
    m = cfg.model
    settings: dict[str, Any] = {"num_labels": CLASSES, **m.settings}
    if m.from_scratch:
        shape = BertConfig if m.backbone == "bert" else RobertaConfig
        return encoder_config(shape(), m.preset, **settings)
    base = backbone_config(m.backbone)
    if m.preset == "backbone" and is_plain_classifier(base):
        return plain_classifier_config(base, **settings)
    return encoder_config(base, m.preset, **settings)


def count_parameters(config: PretrainedConfig) -> dict[str, int]:
    """Parameters of the classifier (`total`, `backbone`: the encoder's, `memory`: the modules the memory
    adds, `largest_layer`: the largest module's own), built on the `meta` device; cached per config."""
    return dict(_count(type(config).__name__, config.to_json_string()))


@functools.lru_cache(maxsize=64)
def _count(config_class: str, config_json: str) -> tuple[tuple[str, int], ...]:
    from ..model.encoder.modeling import MODEL_FOR_CONFIG

    classes = {c.__name__: (c, model) for c, model in MODEL_FOR_CONFIG.items()}
    classes.update({cls.config_class.__name__: (cls.config_class, cls) for cls in PLAIN_CLASSIFIERS.values()})
    config_type, model_type = classes[config_class]
    config = config_type.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = model_type(config)
    total = sum(p.numel() for p in model.parameters())
    backbone = sum(p.numel() for p in model.base_model.parameters())
    memory = sum(p.numel() for mod in model.memory_modules() for p in mod.parameters())
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in model.modules())
    return (("total", total), ("backbone", backbone), ("memory", memory), ("largest_layer", largest))


def attended_keys(config: PretrainedConfig, segment_length: int) -> int:
    """Keys one token attends in self-attention: the whole segment, or the sparse pattern's."""
    if config.model_type == "longformer":
        window = config.attention_window
        window = max(window) if isinstance(window, (list, tuple)) else window
        return min(segment_length, window + 1)  # window/2 each side, and the global first token
    if config.model_type == "big_bird" and config.attention_type == "block_sparse":
        return min(segment_length, (5 + config.num_random_blocks) * config.block_size)  # 3 sliding, 2 global
    return segment_length


def _engrams(config: PretrainedConfig) -> int:
    if isinstance(config, EncoderMemoryFields) and config.use_memory:
        mem = config.memoria_config
        return mem.num_wm + mem.num_reminded
    return 0


def _memory_layers(config: PretrainedConfig) -> int:
    return len(config.memory_layers) if isinstance(config, EncoderMemoryFields) else 0


def activation_bytes(config: PretrainedConfig, micro_batch: int, segment_length: int, fp32: bool = False) -> float:
    """Activations of one micro-batch's forward and backward over one segment (16-bit; x2 in fp32)."""
    s, b, h = segment_length, micro_batch, config.hidden_size
    a, n = config.num_attention_heads, config.num_hidden_layers
    total = n * s * b * h * (34 + 5 * a * attended_keys(config, s) / h)
    total += _memory_layers(config) * (s * b * h * 16 + 5 * a * s * b * _engrams(config))
    return total * (2 if fp32 else 1)


def engram_row(config: PretrainedConfig) -> dict[str, int]:
    """Bytes of one document row's memory (nothing without a memory)."""
    if not _engrams(config):
        return {"capacity": 0}
    return engram_row_bytes(config.memoria_config, config.hidden_size)


def footprint(cfg: RunConfig, world_size: int, zero: str, config: PretrainedConfig) -> Footprint:
    """GPU memory per rank of a classifier run under ZeRO choice `zero` (`footprint.ZERO_CHOICES` key)."""
    params = count_parameters(config)
    stage, offload, _ = ZERO_CHOICES[zero]
    states = zero_model_state_bytes(params["total"], params["largest_layer"], stage, offload,
                                    gpus_per_node=max(world_size, 1))
    o = cfg.optim
    acts = o.bptt_segments * activation_bytes(config, o.micro_batch_size, cfg.data.segment_length,
                                              fp32=o.precision == "fp32")
    return Footprint(params=params, zero=zero, model_states=states, activations=acts,
                     rows_per_rank=o.micro_batch_size * o.grad_accum, engram_row=engram_row(config))


# ------------------------------------------------------------------------------ steps and time

def document_counts(cfg: RunConfig) -> tuple[dict[str, int] | None, str]:
    """Documents per split: the named Hyperpartisan's lists, a local folder's or files' rows; else unknown."""
    d = cfg.data
    if d.path == "hyperpartisan":
        from ..data.hyperpartisan import HYPERPARTISAN_SPLITS

        return ({s: len(v) for s, v in HYPERPARTISAN_SPLITS.items()},
                "Hyperpartisan, Longformer's splits (memoria_ds/data/hyperpartisan.py)")
    try:
        import datasets

        if d.files:
            return ({s: sum(1 for f in fs for _ in open(f, encoding="utf-8")) for s, fs in d.files.items()
                     if all(str(f).endswith(".jsonl") for f in fs)}, "rows of the local files")
        if d.path and Path(d.path).is_dir():
            saved = datasets.load_from_disk(d.path)
            return {s: len(saved[s]) for s in saved}, f"rows of {d.path}"
    except (OSError, ValueError, KeyError) as e:
        return None, f"unknown document counts ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
    return None, "unknown document counts"


def schedule(cfg: RunConfig, world_size: int, eval_splits: tuple[str, ...] = ()) -> cost.Schedule:
    """Steps of a classifier run on `world_size` ranks; the evaluation reads `cfg.eval.split` (at the end)
    and each of `eval_splits` (the evaluate command after training), once per protocol."""
    o, d, e = cfg.optim, cfg.data, cfg.eval
    batch = o.micro_batch_size * o.grad_accum * world_size
    counts, source = document_counts(cfg)
    K = d.max_segments
    per_epoch = math.ceil(counts["train"] / batch) * K // o.bptt_segments if counts and "train" in counts else None
    total = o.max_steps or o.epochs * (per_epoch or 0)
    splits = ((e.split,) if e.at_end else ()) + tuple(s for s in eval_splits if s != e.split)
    eval_steps = sum(len(e.protocols) * math.ceil(counts[s] / batch) * K for s in splits if counts and s in counts)
    return cost.Schedule(per_epoch, total, batch * d.segment_length * o.bptt_segments, eval_steps,
                         o.micro_batch_size * o.grad_accum, source)


def flops_per_token(config: PretrainedConfig, params: int, segment_length: int) -> float:
    """Training FLOPs per token: 6 x parameters, self-attention over the attended keys, Memoria's
    cross-attention over its engrams."""
    flops = 6.0 * params + 12.0 * config.num_hidden_layers * config.hidden_size * attended_keys(config, segment_length)
    return flops + 12.0 * _memory_layers(config) * config.hidden_size * _engrams(config)


def estimate_cost(config: PretrainedConfig, params: int, sched: cost.Schedule, cfg: RunConfig, world_size: int,
                  num_nodes: int, zero_stage: int, offload: bool) -> cost.Cost:
    """GPU-hours of one classifier run (`cost.py`'s method, per segment)."""
    L, o = cfg.data.segment_length, cfg.optim
    compute = flops_per_token(config, params, L) * sched.tokens_per_step / (world_size * cost.A100_BF16_PEAK * cost.MFU)
    layers = config.num_hidden_layers + (cost.MEMORY_BLOCK_FACTOR - 1) * _memory_layers(config)
    block_latency = cost.BLOCK_LATENCY_S * layers
    engine = cost.MEMORY_STEP_S if _engrams(config) else 0.0
    latency = o.grad_accum * o.bptt_segments * (block_latency + engine) + cost.OPTIMIZER_STEP_S
    return cost.step_cost(compute=compute, latency=latency, params=params, sched=sched, segment_length=L,
                          world_size=world_size, num_nodes=num_nodes, zero_stage=zero_stage, offload=offload,
                          block_latency=block_latency, engine=engine)

__all__ = ["PUBLISHED_ENCODERS", "activation_bytes", "attended_keys", "backbone_config", "count_parameters",
           "document_counts", "encoder_model_config", "engram_row", "estimate_cost", "flops_per_token", "footprint",
           "schedule"]
