"""Memoria GPT-2: the memory bolted onto an unmodified HF GPT-2, plus the `transformer` / `xl` baselines.

    from memoria_ds.model import build_model
    model = build_model("gpt2", preset="memoria")          # hub name, local dir, or GPT2Config
    out = model(input_ids, labels=input_ids, memory=None)   # Contract 2 (docs/design.md)
    out = model(next_ids, labels=next_ids, memory=out.memory, reset=new_doc)

See docs/model.md. Importing this package registers the model with the Auto classes, and the
Memoria encoders (BERT and RoBERTa classifiers, `encoder/`, docs/encoders.md) with theirs.
"""

from .build import build_model
from .config import MEMORY_TYPES, PRESETS, MemoriaGPT2Config
from .encoder import (
    MemoriaBertConfig,
    MemoriaBertForSequenceClassification,
    MemoriaRobertaConfig,
    MemoriaRobertaForSequenceClassification,
    apply_encoder_lora,
    build_encoder_model,
)
from .lora import apply_lora
from .modeling import MemoriaCausalLMOutput, MemoriaGPT2LMHeadModel
from .memsizer import MemSizerConfig, MemSizerLMHeadModel
from .mosaic import MemoryMosaicConfig, MemoryMosaicLMHeadModel
from .snapshot import Snapshot, SnapshotMismatch, load_snapshot, model_fingerprint, read, save_snapshot
from .recurrent import (
    KINDS,
    MemoriaMemory,
    MemoriaRead,
    MemoryKind,
    MemoryRead,
    NoMemory,
    RecurrentMemory,
    XLMemory,
    XLRead,
    memory_from_state_dict,
)

__all__ = [
    "MemoriaGPT2Config",
    "MemoriaGPT2LMHeadModel",
    "MemoriaCausalLMOutput",
    "MemoryMosaicConfig",
    "MemoryMosaicLMHeadModel",
    "MemSizerConfig",
    "MemSizerLMHeadModel",
    "MemoryRead",
    "MemoriaRead",
    "XLRead",
    "MemoryKind",
    "KINDS",
    "build_model",
    "apply_lora",
    "build_encoder_model",
    "apply_encoder_lora",
    "MemoriaBertConfig",
    "MemoriaBertForSequenceClassification",
    "MemoriaRobertaConfig",
    "MemoriaRobertaForSequenceClassification",
    "PRESETS",
    "MEMORY_TYPES",
    "MemoriaMemory",
    "XLMemory",
    "NoMemory",
    "RecurrentMemory",
    "memory_from_state_dict",
    "Snapshot",
    "SnapshotMismatch",
    "load_snapshot",
    "model_fingerprint",
    "read",
    "save_snapshot",
]
