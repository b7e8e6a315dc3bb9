"""One segment runner: streams in, one model call per segment, the memory carried between them.

    for seg in run_segments(model, streams, steps=n, reset=policy, device=dev):
        seg.step, seg.batch (StreamBatch), seg.logits (B, L, V), seg.output (.memory_stats, ...)

Both evaluations (eval/perplexity.py, eval/sorting.py) and `generate()`'s prompt
(generation.py) read their segments through it; the training loop (train/loop.py) calls the
same `forward_segment` once per micro-batch slot, with its labels and a memory per slot.
`streams` is anything with `steps_per_epoch` and `batch_at(epoch, step) -> StreamBatch`
(`TokenStreams` for text, `ExampleStreams` for fixed-length examples): the runner does not
know which. A row's memory is reset where `reset.reset_mask(batch)` says (a document
or example start, or a periodic reset), before the model reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from memoria_ds.data.batch import StreamBatch
from memoria_ds.data.reset import ResetPolicy


class Streams(Protocol):
    """Segments of B rows, addressable by (epoch, step)."""

    @property
    def steps_per_epoch(self) -> int: ...

    def batch_at(self, epoch: int, step: int) -> StreamBatch: ...


@dataclass
class Segment:
    """One segment's model call: its step, the batch (on the model's device), the output, and
    the (B,) bool rows reset before it (None where the caller did not say)."""

    step: int
    batch: StreamBatch
    output: Any
    reset: torch.Tensor | None = None

    @property
    def logits(self) -> torch.Tensor:
        return logits_and_memory(self.output)[0]


def forward_segment(model: Any, batch: StreamBatch, memory: Any, reset: torch.Tensor,
                    labels: torch.Tensor | None = None, attention_mask: bool = False) -> Any:
    """One segment through a Contract-2 model: its whole output (`.logits`, `.memory`, `.loss`, ...).

    `labels` are the batch's aligned targets (or a slice of them) when a loss is wanted; they
    go in as HF's `shift_labels` (already aligned, no further shift). A batch of labelled
    documents (`batch.labels` set) goes to a classifier: `labels` (B,) and the attention mask. `attention_mask`: pass
    the batch's (a prompt's padding); streams pad only at their very end, where nothing
    follows, so they do without.
    """
    if getattr(batch, "labels", None) is not None:  # a classifier (`DocumentStreams`): `labels` are document labels
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels, memory=memory,
                     reset=reset)
    mask = {"attention_mask": batch.attention_mask} if attention_mask else {}
    return model(input_ids=batch.input_ids, shift_labels=labels, memory=memory, reset=reset, **mask)


def logits_and_memory(out: Any) -> tuple[torch.Tensor, Any]:
    """(logits (B, L, V), the memory to carry) of a model output (a ModelOutput or a dict)."""
    logits = out["logits"] if isinstance(out, dict) else out.logits
    new_memory = out.get("memory") if isinstance(out, dict) else getattr(out, "memory", None)
    return logits, new_memory


def run_segments(
    model: Any,
    streams: Streams,
    *,
    reset: ResetPolicy,
    device: torch.device,
    steps: int | None = None,
    epoch: int = 0,
    memory: Any = None,
    progress: str | None = None,
    attention_mask: bool = False,
    forget: str | None = None,
) -> Iterator[Segment]:
    """Feed segments 0..steps-1 of `epoch` through `model`, carrying the memory it returns.

    Args:
        model: called as `model(input_ids=, shift_labels=None, memory=, reset=)` (Contract 2).
        streams: where the segments come from (see `Streams`).
        reset: which rows start with an empty memory at each segment.
        device: where the batches go.
        steps: how many segments (default: the whole epoch).
        epoch: which epoch of the streams.
        memory: the memory to start from (None: fresh). A given memory is kept through the
            first segment (it is the context the caller chose, e.g. a snapshot of the text
            read before); later segments are reset as `reset` says.
        progress: a progress bar with this label (None: no bar).
        attention_mask: pass each batch's attention mask to the model (`forward_segment`).
        forget: a part of a composite memory (`xl` of `xl+memoria`) reset before every segment,
            the others carried (`memory.reset_part`).

    Yields:
        A `Segment` per step, after the model call; the memory the next segment reads is the
        one this call returned.
    """
    steps = streams.steps_per_epoch if steps is None else steps
    keep_first = memory is not None
    for step in tqdm(range(steps), desc=progress, disable=progress is None):
        batch = streams.batch_at(epoch, step).to(device)
        mask = reset.reset_mask(batch)
        if keep_first and step == 0:
            mask = torch.zeros_like(mask)
        if forget is not None and memory is not None:
            memory.reset_part(forget)
        out = forward_segment(model, batch, memory, mask, attention_mask=attention_mask)
        memory = logits_and_memory(out)[1]
        yield Segment(step, batch, out, mask)
