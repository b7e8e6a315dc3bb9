"""generate() with memory: the prompt goes through memory segment by segment, then decoding.

A prompt of T tokens is cut into segments of S. The complete segments but the last are
fed through `forward` as memory steps (updating the memory in place). The rest of the
prompt starts the current segment, and HF's `generate()` decodes in it with its usual
decode cache, attending to a *frozen read* of the memory (`memory_context`): Memoria's
working memory from the last fed segment and the engrams it reminds (read from a copy of
the engine state, so the memory itself is untouched), or Transformer-XL's cached
keys/values. The generated segment is not memorized; `len(rest) + max_new_tokens` must
fit in the positions of a segment (GPT-2's `n_positions`; half of them for `xl` with
alternating positions).

Notation: B rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.generation import GenerationMixin

from ..data.batch import IGNORE_INDEX, StreamBatch
from ..data.reset import ResetPolicy
from ..data.segments import run_segments
from .recurrent import MemoryRead, RecurrentMemory


class PromptSegments:
    """The first `count` complete segments of a (B, T) prompt, as the segment runner reads them.

    One row per prompt (stream ids 0..B-1); the attention mask is the caller's (1 where no
    mask was given); nothing is scored (targets all -100).
    """

    def __init__(self, input_ids: Tensor, attention_mask: Tensor | None, segment_length: int, count: int) -> None:
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.segment_length, self.steps_per_epoch = segment_length, count

    def batch_at(self, epoch: int, step: int) -> StreamBatch:
        S, B = self.segment_length, self.input_ids.shape[0]
        ids = self.input_ids[:, step * S:(step + 1) * S]
        mask = (self.attention_mask[:, step * S:(step + 1) * S] if self.attention_mask is not None
                else torch.ones_like(ids))
        rows = torch.arange(B, device=ids.device)
        return StreamBatch(input_ids=ids, targets=torch.full_like(ids, IGNORE_INDEX), attention_mask=mask,
                           doc_start=torch.zeros(B, dtype=torch.bool, device=ids.device),
                           doc_start_pos=torch.full((B,), -1, device=ids.device), stream_ids=rows, epoch=epoch,
                           step=step, global_step=step)


class MemoryGenerationMixin(GenerationMixin):
    """HF's `GenerationMixin` plus the memory: mixed into `MemoriaGPT2LMHeadModel`."""

    @torch.no_grad()
    def memory_context(
        self, memory: RecurrentMemory | None, batch_size: int, device: torch.device | str | None = None
    ) -> MemoryRead:
        """What a segment decoded after `memory` attends to, without changing `memory`.

        The memory kind's frozen read (`recurrent/`): for Memoria the working memory from
        the last segment and the engrams it reminds (read from a copy of the state), for
        `xl` the cached keys/values, for `none` nothing.
        """
        device = torch.device(device) if device is not None else self.transformer.wte.weight.device
        dtype = self.transformer.wte.weight.dtype
        kind = self.memory_kind
        memory = kind.prepare(memory, batch_size, device, dtype, None)
        return kind.frozen_read(memory, dtype, self.kind_module)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        memory: RecurrentMemory | None = None,
        segment_length: int | None = None,
        attention_mask: Tensor | None = None,
        **kwargs: Any,
    ):
        """HF `generate()` with memory: the prompt goes through memory segment by segment.

        The prompt is cut into segments of `segment_length` (default
        `config.segment_length`; a prompt that fits in `n_positions` may omit it). All
        complete segments but the last are fed through `forward` as memory steps
        (updating `memory` in place); the rest of the prompt starts the current segment,
        and decoding continues in it with a frozen read of the memory (the generated
        segment is not memorized). `len(rest) + max_new_tokens` must fit in `n_positions`.

        Args:
            input_ids: (B, T) prompt.
            memory: memory to continue from (None = fresh).
            segment_length: segment length for the prompt.
            attention_mask: (B, T), optional.
            **kwargs: anything HF's `generate()` takes (max_new_tokens, do_sample, ...).

        Returns:
            What HF's `generate()` returns, with the whole prompt in front of the sequences.
        """
        B, T = input_ids.shape
        S = segment_length or self.config.segment_length
        if S is None:
            if T > self.config.positions_per_segment:
                raise ValueError(
                    f"a prompt of {T} tokens exceeds the {self.config.positions_per_segment} positions of a segment "
                    f"(n_positions={self.config.n_positions}): pass `segment_length` "
                    f"(or set config.segment_length) to feed it through memory segment by segment"
                )
            S = T
        n_full = (T - 1) // S  # complete segments before the one decoding continues
        if not self.memory_kind.carries_state:
            memory = None  # the prefix has no effect on the plain backbone: skip computing it
        elif n_full:  # the complete segments through the memory, by the one segment runner
            prompt = PromptSegments(input_ids, attention_mask, S, n_full)
            for seg in run_segments(self, prompt, reset=ResetPolicy(), device=input_ids.device, memory=memory,
                                    attention_mask=attention_mask is not None):
                memory = seg.output.memory
        start = n_full * S
        context = self.memory_context(memory, B, input_ids.device)
        tail_mask = attention_mask[:, start:] if attention_mask is not None else None
        out = super().generate(input_ids[:, start:], attention_mask=tail_mask, memory_context=context, **kwargs)
        sequences = out if isinstance(out, Tensor) else out.sequences
        prefix = input_ids[:, :start].repeat_interleave(sequences.shape[0] // B, dim=0)
        sequences = torch.cat([prefix, sequences], dim=1)
        if isinstance(out, Tensor):
            return sequences
        out.sequences = sequences
        return out

    def _expand_inputs_for_generation(
        self,
        expand_size: int = 1,
        is_encoder_decoder: bool = False,
        input_ids: Tensor | None = None,
        **model_kwargs: Any,
    ):
        """HF expands tensors for beams / several return sequences; expand the memory read too."""
        context = model_kwargs.pop("memory_context", None)
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size, is_encoder_decoder, input_ids, **model_kwargs
        )
        if context is not None and expand_size > 1:
            rows = torch.arange(input_ids.shape[0] // expand_size).repeat_interleave(expand_size)
            context = context.take_rows(rows)
        model_kwargs["memory_context"] = context
        return input_ids, model_kwargs


__all__ = ["MemoryGenerationMixin"]
