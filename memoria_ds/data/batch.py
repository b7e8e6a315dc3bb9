"""StreamBatch: what one step of the streams hands to the model (Contract 3).

Notation: B rows on this rank (B_local), L segment length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

IGNORE_INDEX = -100  # HF's ignore index: a target that is not scored


@dataclass
class StreamBatch:
    """Segment `step` of every stream this rank owns.

    Attributes:
        input_ids: (B, L) int64 token ids; padding past a stream's end is `pad_id`.
        targets: (B, L) int64, the next token of each position in the stream
            (`targets[b, i]` is the token that follows `input_ids[b, i]`), or -100 where
            there is none: padding, and the very last token of the data. Pass them to the
            model as `shift_labels` (already aligned, no further shift).
        attention_mask: (B, L) int64, 1 for real tokens, 0 for padding (padding only ever
            trails at the end of a stream).
        doc_start: (B,) bool. True when the memory this row carries belongs to other
            text: a document boundary lies after the first token of the row's previous
            segment and at or before this segment's first token (a document started at
            position 0 of this segment, or anywhere inside the previous one), or this is
            the row's first segment of an epoch. Reset policies read this flag.
        doc_start_pos: (B,) int64, position in this segment of the first document start
            inside it, -1 if none (for models that want to mask attention within a
            segment; reset policies do not use it).
        stream_ids: (B,) int64 global stream ids of the rows (memory row ids).
        epoch: epoch index (0-based).
        step: segment index within the epoch (0-based).
        global_step: `epoch * steps_per_epoch + step`.
        labels: (B,) int64, a classification task's label of each row's document, -100 where
            this segment holds none of it (`DocumentStreams`); None for language modelling.
        last: (B,) bool, this segment is the last of the row's document (`DocumentStreams`), or None.
        tasks: (B,) int64, the task of each row's document (labelled documents with a `task` column: a
            lifelong run's), -1 for a padding row; None otherwise.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor
    doc_start: torch.Tensor
    doc_start_pos: torch.Tensor
    stream_ids: torch.Tensor
    epoch: int
    step: int
    global_step: int
    labels: torch.Tensor | None = None
    last: torch.Tensor | None = None
    tasks: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "StreamBatch":
        """A copy with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def rows(self, index: slice) -> "StreamBatch":
        """The batch of rows `index` (a micro-batch of a training step)."""
        picked = {f.name: getattr(self, f.name)[index] for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **picked)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def segment_length(self) -> int:
        return int(self.input_ids.shape[1])
