"""What the from-scratch families' language models share (model/families.py): a `PreTrainedModel`
in Contract 2 whose body is a `ModuleDict` named by `base_model_prefix` (`wte`, `drop`, `h`,
`ln_f`) with an `lm_head` tied to `wte`, and whose memory across segments is a `MemoryKind`.

A family's model keeps its own blocks, initialisation and the arithmetic of its forward; this
class holds the accessors, the memory kind, the argument checks before a segment and the
logits and loss after it, and generation's inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_utils import slice_logits_to_keep

from .modeling import MemoriaCausalLMOutput
from .recurrent import MemoryKind, memory_kind

IGNORED_BY_GENERATION = ("cache_position", "past_key_values", "cache", "position_ids")


class FamilyLMHeadModel(PreTrainedModel, GenerationMixin):
    """The shared part of a family's LM (`MemoryMosaicLMHeadModel`, `MemSizerLMHeadModel`)."""

    supports_gradient_checkpointing = True
    _supports_sdpa = True  # accepted so that the toolkit's default builds it (a family dispatches nothing)
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = False

    @property
    def body(self) -> nn.ModuleDict:
        """The model's body (`wte`, `drop`, `h`, `ln_f`), under its `base_model_prefix`."""
        return getattr(self, self.base_model_prefix)

    def get_input_embeddings(self) -> nn.Module:
        return self.body.wte

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.body.wte = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def memory_modules(self) -> list[nn.Module]:
        """Modules added to a backbone: none (every weight is the model's own)."""
        return []

    # ------------------------------------------------------------------ memory (Contract 2)
    @property
    def memory_kind(self) -> MemoryKind:
        """The kind of memory carried between segments (`memory_type`: `none` reads every segment fresh)."""
        kind = self.__dict__.get("_memory_kind")
        if kind is None or kind.config is not self.config:
            kind = self.__dict__["_memory_kind"] = memory_kind(self.config)
        return kind

    def empty_memory(self, batch_size: int, device: torch.device | str | None = None) -> Any:
        device = device if device is not None else self.body.wte.weight.device
        return self.memory_kind.empty(batch_size, device, self.dtype)

    # ------------------------------------------------------------------ a segment's edges
    def _check_segment(self, input_ids: Tensor, labels: Tensor | None, shift_labels: Tensor | None,
                       inputs_embeds: Tensor | None, output_attentions: bool | None,
                       output_hidden_states: bool | None, kwargs: dict[str, Any]) -> Any:
        """Refuse what a segment cannot take; returns `num_items_in_batch` (popped from `kwargs`).

        Raises:
            TypeError: an unknown argument.
            ValueError: a segment longer than n_positions, both kinds of labels, unsupported inputs.
        """
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        for name in IGNORED_BY_GENERATION:
            kwargs.pop(name, None)  # generation passes them; nothing is cached
        if kwargs:
            raise TypeError(f"unexpected argument(s) {sorted(kwargs)}")
        if inputs_embeds is not None or output_attentions or output_hidden_states:
            raise ValueError("pass `input_ids`; inputs_embeds / output_attentions / output_hidden_states "
                             "are not supported")
        if labels is not None and shift_labels is not None:
            raise ValueError("pass `labels` (shifted inside) or `shift_labels` (already aligned), not both")
        if input_ids.shape[1] > self.config.n_positions:
            raise ValueError(f"a segment of {input_ids.shape[1]} tokens exceeds n_positions="
                             f"{self.config.n_positions}; use shorter segments")
        return num_items_in_batch

    def _output(self, x: Tensor, memory: Any, labels: Tensor | None, shift_labels: Tensor | None,
                logits_to_keep: int | Tensor, num_items_in_batch: Any) -> MemoriaCausalLMOutput:
        """The logits of the final hidden states x (B, L, D), and the loss when labels are given."""
        logits = self.lm_head(slice_logits_to_keep(x, logits_to_keep))  # (B, L, V)
        loss = None
        if labels is not None or shift_labels is not None:
            if logits.shape[1] != x.shape[1]:
                raise ValueError("a loss needs the logits of every position (logits_to_keep=0)")
            loss = ForCausalLMLoss(logits, labels, self.config.vocab_size, num_items_in_batch=num_items_in_batch,
                                   shift_labels=shift_labels)
        return MemoriaCausalLMOutput(loss=loss, logits=logits, memory=memory, memory_stats=None)

    def prepare_inputs_for_generation(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                                      **kwargs: Any) -> dict[str, Any]:
        """Generation re-reads the whole sequence at each step (no decode cache)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "logits_to_keep": kwargs.get("logits_to_keep") or 1}


__all__ = ["FamilyLMHeadModel"]
