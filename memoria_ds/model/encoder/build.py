"""Build a Memoria BERT or RoBERTa classifier from a hub name, a local directory or a config."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, PretrainedConfig

from .config import encoder_config
from .modeling import MODEL_FOR_CONFIG, MemoriaBertForSequenceClassification, MemoriaRobertaForSequenceClassification
from .plain import SegmentClassifier, build_plain_classifier, is_plain_classifier


def build_encoder_model(
    backbone: str | os.PathLike | PretrainedConfig,
    preset: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    **settings: Any,
) -> MemoriaBertForSequenceClassification | MemoriaRobertaForSequenceClassification | SegmentClassifier:
    """A Memoria sequence classifier around a BERT or RoBERTa backbone (or, with preset `backbone`, a
    Longformer or BigBird classifier without memory: `plain.py`).

    Args:
        backbone: a hub name (`"bert-base-uncased"`, `"roberta-base"`) or a local directory of a BERT or
            RoBERTa checkpoint (a bare encoder, a masked LM or a sequence classifier): its weights are
            loaded by name, the memory modules initialised (an exact no-op with the default
            `memory_init="noop"`) and a head the checkpoint lacks, or has for another number of
            classes, drawn as HF draws it. A directory
            saved from this class loads as it was (settings override its config). A `BertConfig` /
            `RobertaConfig`: a from-scratch model with random weights.
        preset: a name of `ENCODER_PRESETS` (`"memoria"`, `"memoria_authors"`, `"memoria_wm"`,
            `"memoria_wm_stm"`, `"backbone"`). With `"backbone"`, a Longformer or BigBird backbone is
            built as HF's classifier read by the loop (`build_plain_classifier`; settings are its config's).
        dtype: parameter dtype (e.g. `torch.bfloat16`); the memory state stays fp32.
        attn_implementation: `"sdpa"` (default) or `"eager"`, for the backbone and the memory attention.
        **settings: fields of the Memoria config: the memory's (`memoria={"num_wm": 16}`,
            `memory_layer_index=1`, ...) or the backbone's (`num_labels=2`, `classifier_dropout=0.1`).

    Returns:
        The model, in HF's mode: eval when loaded from a checkpoint, train when built from a config.

    Raises:
        ValueError: a backbone that is neither BERT nor RoBERTa, an unknown preset.
        SettingError: a setting that does not validate.
    """
    source = backbone if isinstance(backbone, PretrainedConfig) else AutoConfig.from_pretrained(backbone)
    if preset == "backbone" and is_plain_classifier(source):
        return build_plain_classifier(backbone, dtype=dtype, **settings)
    if isinstance(backbone, PretrainedConfig):
        config = encoder_config(backbone, preset, attn_implementation=attn_implementation, **settings)
        # from_config, not the constructor: under ZeRO-3 (an `HfDeepSpeedConfig` alive) HF partitions
        # the weights while building and initialises them gathered
        return AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    saved = source
    config = encoder_config(saved, preset, **settings)
    # a classifier checkpoint with another number of classes: its head is drawn afresh (HF's fine-tuning rule)
    other_head = saved.num_labels != config.num_labels
    return MODEL_FOR_CONFIG[type(config)].from_pretrained(backbone, config=config, dtype=dtype,
                                                          attn_implementation=attn_implementation,
                                                          ignore_mismatched_sizes=other_head)


__all__ = ["build_encoder_model"]
