"""Classifiers without a memory, read by the classification loop: Longformer and BigBird (Table 3), and GPT-2.

The paper's Table 3 sets Memoria BERT / RoBERTa (segments of 512) beside two encoders that read
the document whole, Longformer and BigBird at 4,096 tokens, through their Hugging Face classes (the
authors' `train_classification.py` loads them with `AutoModelForSequenceClassification`). Here each
is HF's own class, its forward unchanged, with the small contract the toolkit's loop and evaluation
call (`memory`, `reset`, `empty_memory`, `prepare_memory`, `memory_modules`), as preset `backbone`
gives it to BERT and RoBERTa: the memory is a `NoMemory` (the batch size alone). With
`data.segment_length=4096 data.max_segments=1` the loop reads each document's first 4,096 tokens
as one sequence, `[CLS] ... [SEP]` (`<s> ... </s>`), as the authors' tokenizer call does.

    model = build_plain_classifier("allenai/longformer-base-4096", num_labels=2)
    out = model(input_ids, attention_mask=mask, labels=y)       # out.logits (B, K), out.memory NoMemory

A checkpoint saved from these classes is a plain HF checkpoint (its `model_type` is `longformer` /
`big_bird`): `AutoModelForSequenceClassification` loads it as HF's class.

GPT-2 (`gpt2`, `gpt2-medium`, ..., or `model.from_scratch` from a GPT-2 config) is read as HF's
`GPT2ForSequenceClassification`, a causal model that classifies at a row's last token: here the last token
the attention mask keeps (the documents are right-padded), whatever the padding id (GPT-2 has none).
MbPA++ (docs/episodic.md) trains it like the encoders; its keys are the last real token's hidden state.

Longformer puts global attention on the first token when none is given (HF's rule for
classification, which the authors relied on); BigBird switches to full attention by itself when a
sequence is too short for its block-sparse pattern.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor
from transformers import (AutoConfig, BigBirdForSequenceClassification, GPT2ForSequenceClassification,
                          LongformerForSequenceClassification, PretrainedConfig)

from ..recurrent.none import NoMemory
from .modeling import MemoriaEncoderModel, MemoriaSequenceClassifierOutput


class SegmentClassifier:
    """What the loop calls on a classifier, for an HF sequence classifier that has no memory.

    A subclass puts this before HF's class; its weights, init, save and load are HF's.
    """

    # learned positions start after the padding index (RoBERTa's rule, which Longformer keeps)
    position_offset_from_pad: bool = False

    def memory_modules(self) -> list[torch.nn.Module]:
        """Nothing added to the backbone."""
        return []

    def empty_memory(self, batch_size: int, device: torch.device | str | None = None) -> NoMemory:
        return NoMemory(batch_size)

    def prepare_memory(self, memory: NoMemory | None, batch_size: int, device: torch.device,
                       reset: Tensor | None) -> NoMemory:
        """`memory` checked (a `NoMemory` of this batch) or a fresh one; `reset` changes nothing.

        Raises:
            ValueError: another memory, or one of another batch size.
        """
        if memory is not None and not (isinstance(memory, NoMemory) and memory.batch_size == batch_size):
            raise ValueError(f"{type(self).__name__} has no memory: pass memory=None or the NoMemory of {batch_size} "
                             f"rows a previous call returned, got {memory!r}")
        return memory if memory is not None else NoMemory(batch_size)

    @property
    def positions_per_segment(self) -> int:
        """The longest sequence the learned positions embed."""
        cfg = self.config
        offset = cfg.pad_token_id + 1 if self.position_offset_from_pad else 0
        return cfg.max_position_embeddings - offset

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None, memory: NoMemory | None = None,
                reset: Tensor | None = None, **kwargs: Any) -> MemoriaSequenceClassifierOutput:
        """HF's forward on one sequence per row; the loss as the Memoria encoders compute it.

        Args:
            input_ids / attention_mask / token_type_ids / position_ids: as HF's class takes them, (B, L).
            labels: (B,) class indices (-100: the row is ignored); the loss is the mean over labelled rows
                (0 when none is), or the sum over them divided by `num_items_in_batch` when given.
            memory / reset: the loop's; a `NoMemory` (or None), and nothing to reset.
            **kwargs: `num_items_in_batch`; anything else goes to HF's forward (e.g. Longformer's
                `global_attention_mask`).

        Raises:
            ValueError: a memory that is not this batch's `NoMemory`, or a sequence longer than the positions.
        """
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        B, L = input_ids.shape
        if L > self.positions_per_segment:
            raise ValueError(f"a sequence of {L} tokens exceeds the {self.positions_per_segment} positions "
                             f"{type(self).__name__} embeds; use data.segment_length <= {self.positions_per_segment}")
        memory = self.prepare_memory(memory, B, input_ids.device, reset)
        logits = self._logits(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              position_ids=position_ids, **kwargs)
        loss = self._loss(logits, labels, num_items_in_batch) if labels is not None else None
        return MemoriaSequenceClassifierOutput(loss=loss, logits=logits, memory=memory, memory_stats=None)

    def _logits(self, **inputs: Any) -> Tensor:
        """(B, K) logits: HF's own forward."""
        return super().forward(**inputs).logits

    _loss = MemoriaEncoderModel._loss


class SegmentLongformerForSequenceClassification(SegmentClassifier, LongformerForSequenceClassification):
    """HF's `LongformerForSequenceClassification` read by the loop (no memory)."""

    position_offset_from_pad = True


class SegmentBigBirdForSequenceClassification(SegmentClassifier, BigBirdForSequenceClassification):
    """HF's `BigBirdForSequenceClassification` read by the loop (no memory)."""


class SegmentGPT2ForSequenceClassification(SegmentClassifier, GPT2ForSequenceClassification):
    """HF's `GPT2ForSequenceClassification` read by the loop (no memory): each row's logits at its last token
    that the attention mask keeps (HF's own rule looks for the padding id, which GPT-2 does not have)."""

    def _logits(self, input_ids: Tensor, attention_mask: Tensor | None = None, **inputs: Any) -> Tensor:
        """(B, K) logits at each row's last kept token ((B, L) inputs, right-padded)."""
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask, **inputs).last_hidden_state
        B, L = input_ids.shape
        last = (attention_mask.sum(1) - 1).clamp(min=0) if attention_mask is not None else torch.full(
            (B,), L - 1, device=input_ids.device)  # (B,)
        return self.score(hidden[torch.arange(B, device=hidden.device), last])  # (B, K)


# HF model type -> the class the loop reads it with
PLAIN_CLASSIFIERS: dict[str, type] = {"longformer": SegmentLongformerForSequenceClassification,
                                      "big_bird": SegmentBigBirdForSequenceClassification,
                                      "gpt2": SegmentGPT2ForSequenceClassification}


def is_plain_classifier(config: PretrainedConfig) -> bool:
    """Whether `config` is of a type read by `PLAIN_CLASSIFIERS` (Longformer, BigBird, GPT-2)."""
    return getattr(config, "model_type", None) in PLAIN_CLASSIFIERS


def plain_classifier_config(backbone: PretrainedConfig | str | os.PathLike, **settings: Any) -> PretrainedConfig:
    """The config `build_plain_classifier` builds from: the backbone's, with `settings` (e.g. `num_labels`,
    `id2label`) set on it.

    Raises:
        ValueError: a backbone of another type, or a setting the config does not have.
    """
    config = backbone if isinstance(backbone, PretrainedConfig) else AutoConfig.from_pretrained(backbone)
    if not is_plain_classifier(config):
        raise ValueError(f"the backbone is a {config.model_type!r} model; the long-input classifiers without memory "
                         f"are {sorted(PLAIN_CLASSIFIERS)} (Longformer, BigBird, GPT-2)")
    config = config.__class__.from_dict(config.to_dict())  # a copy: the caller's config is left as it was
    for key, value in settings.items():
        if key not in ("num_labels", "id2label", "label2id") and not hasattr(config, key):
            raise ValueError(f"{config.model_type} has no setting {key!r}")
        setattr(config, key, value)
    if "id2label" in settings and "label2id" not in settings:
        config.label2id = {name: int(i) for i, name in config.id2label.items()}
    return config


def build_plain_classifier(backbone: PretrainedConfig | str | os.PathLike, *, dtype: torch.dtype | None = None,
                           **settings: Any) -> SegmentClassifier:
    """A Longformer, BigBird or GPT-2 sequence classifier the loop reads (its checkpoint's weights, a head of
    `num_labels` drawn as HF draws it when the checkpoint has none or another size).

    Args:
        backbone: a hub name (`allenai/longformer-base-4096`, `google/bigbird-roberta-base`), a local
            directory, or a config (a from-scratch model with random weights).
        dtype: parameter dtype. (The attention is each model's own: Longformer's sliding window,
            BigBird's block-sparse pattern; `model.attn_implementation` does not apply.)
        **settings: config fields (`num_labels`, `id2label`, `attention_window`, ...).

    Raises:
        ValueError: a backbone of another type.
    """
    if isinstance(backbone, PretrainedConfig):
        config = plain_classifier_config(backbone, **settings)
        # HF's _from_config, not the constructor: under ZeRO-3 it builds straight into partitions
        return PLAIN_CLASSIFIERS[config.model_type]._from_config(config, dtype=dtype)
    saved = AutoConfig.from_pretrained(backbone)
    config = plain_classifier_config(saved, **settings)
    return PLAIN_CLASSIFIERS[config.model_type].from_pretrained(
        backbone, config=config, dtype=dtype, ignore_mismatched_sizes=saved.num_labels != config.num_labels)


__all__ = ["PLAIN_CLASSIFIERS", "SegmentBigBirdForSequenceClassification", "SegmentClassifier",
           "SegmentGPT2ForSequenceClassification", "SegmentLongformerForSequenceClassification", "build_plain_classifier", "is_plain_classifier",
           "plain_classifier_config"]
