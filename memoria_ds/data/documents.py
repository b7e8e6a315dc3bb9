"""DocumentStreams: labelled documents of any length, classified segment by segment.

Notation: E documents, B = B_global rows, w ranks, L segment length, K segments per
document slot (`max_segments`), n_e = the segments document e fills (1 <= n_e <= K).

A document's tokens are cut into segments of L - s tokens (s: the special tokens around each
segment, `[CLS] ... [SEP]` for BERT, `<s> ... </s>` for RoBERTa, none without a `cls_id`):
every segment is a sequence the encoder reads on its own, as the authors' Hyperpartisan loader
builds them. A document longer than K segments keeps its first K (`truncated` counts them).
Batch i of an epoch is documents `order[i B : (i + 1) B]`; its K segments are steps
`i K .. i K + K - 1`, and every row's memory is reset at the first (`doc_start`). A row whose
document filled its n_e segments feeds padding after them: its attention mask is 0 there
and its label -100, so it is neither trained nor scored, and its memory is reset before its
next document. Each batch carries, per row, the document's `labels` (-100 where the segment
holds no token of it) and `last` (the document's last segment: where an evaluation reads the
prediction, as the authors' evaluation does). Rank r owns rows [r B / w, (r + 1) B / w).
The cursor, order and resume are `ExampleStreams`'.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import datasets
import numpy as np
import torch

from memoria_ds.data.batch import IGNORE_INDEX, StreamBatch
from memoria_ds.data.examples import ExampleStreams

_STATE_FORMAT = "memoria_ds.document_streams/1"


def document_segments(tokens: list[int] | np.ndarray, segment_length: int, max_segments: int,
                      cls_id: int | None = None, sep_id: int | None = None) -> list[np.ndarray]:
    """The segments of one document: runs of `segment_length - s` tokens, each between `cls_id`
    and `sep_id` (s = how many of them are given), at most `max_segments` (the first ones); an
    empty document is one segment of its special tokens alone.

    Raises:
        ValueError: a segment too short to hold a token between its special tokens.
    """
    specials = (cls_id is not None) + (sep_id is not None)
    body = segment_length - specials
    if body < 1:
        raise ValueError(f"a segment of {segment_length} tokens has no room for text between its {specials} "
                         f"special tokens")
    tokens = np.asarray(tokens, dtype=np.int64)
    count = max(1, min(max_segments, math.ceil(len(tokens) / body)))
    out = []
    for k in range(count):
        part = [tokens[k * body:(k + 1) * body]]
        if cls_id is not None:
            part.insert(0, np.array([cls_id], dtype=np.int64))
        if sep_id is not None:
            part.append(np.array([sep_id], dtype=np.int64))
        out.append(np.concatenate(part))
    return out


def _content_fingerprint(dataset: datasets.Dataset) -> str:
    """A hash of the documents' tokens and labels, in order (the same data read again from a rewritten
    file has the same one; `datasets`' own fingerprint follows the file's path and time)."""
    h = hashlib.sha256()
    for row in dataset.with_format("numpy").iter(batch_size=1024):
        for ids in row["input_ids"]:
            h.update(np.asarray(ids, dtype=np.int64).tobytes())
            h.update(b"|")
        h.update(np.asarray(row["label"], dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


class DocumentStreams(ExampleStreams):
    """Labelled documents, B_global at a time, each read as up to K consecutive segments.

    Args:
        dataset: rows with `input_ids` (the document's tokens, no special tokens) and `label` (int).
        batch_size: B_global, rows per batch over all ranks (a multiple of `world_size`).
        segment_length: L, special tokens included.
        max_segments: K, segments a document may fill (the rest of a longer one is dropped).
        rank, world_size, shuffle, seed, drop_last, pad_id: as `ExampleStreams`.
        cls_id / sep_id: the tokenizer's tokens around each segment (None: none).
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        *,
        batch_size: int,
        segment_length: int,
        max_segments: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        pad_id: int = 0,
        cls_id: int | None = None,
        sep_id: int | None = None,
    ) -> None:
        if max_segments < 1:
            raise ValueError(f"`max_segments` ({max_segments}) must be >= 1")
        missing = {"input_ids", "label"} - set(dataset.column_names)
        if missing:
            raise ValueError(f"documents need the columns input_ids and label; missing {sorted(missing)}")
        self._set_layout(dataset, batch_size, segment_length, rank, world_size, shuffle, seed, drop_last, pad_id)
        document_segments([], segment_length, max_segments, cls_id, sep_id)  # room for text in a segment
        self.max_segments, self.cls_id, self.sep_id = max_segments, cls_id, sep_id
        self.segments_per_example = max_segments
        self.example_length = max_segments * segment_length
        self.scored_segments = frozenset(range(max_segments))
        body = segment_length - (cls_id is not None) - (sep_id is not None)
        lengths = np.fromiter((len(x) for x in dataset["input_ids"]), dtype=np.int64, count=len(dataset))
        self.truncated = int((lengths > max_segments * body).sum())
        self.fingerprint = _content_fingerprint(dataset)
        self.has_tasks = "task" in dataset.column_names  # a lifelong run's documents say their task

    def _rows(self, epoch: int, batch: int) -> tuple[np.ndarray, ...]:  # type: ignore[override]
        """(B_local, K, L) inputs and attention mask, (B_local,) labels, segments filled (0: a padding row) and
        tasks (-1: a padding row, or no `task` column)."""
        if self._cache is not None and self._cache[0] == (epoch, batch):
            return self._cache[1]
        order = self._order(epoch)
        rows, K, L = len(self.stream_ids), self.max_segments, self.segment_length
        inputs = np.full((rows, K, L), self.pad_id, dtype=np.int64)
        mask = np.zeros((rows, K, L), dtype=np.int64)
        labels = np.full(rows, IGNORE_INDEX, dtype=np.int64)
        filled = np.zeros(rows, dtype=np.int64)
        tasks = np.full(rows, -1, dtype=np.int64)  # (only read when the documents have a `task` column)
        for r, slot in enumerate(self.stream_ids):
            j = batch * self.batch_size + slot
            if j >= len(order):
                continue
            row = self.dataset[int(order[j])]
            label = row["label"]
            if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or label < 0:
                raise ValueError(f"document {int(order[j])} has label {label!r}: a class index (an int >= 0)")
            segments = document_segments(row["input_ids"], L, K, self.cls_id, self.sep_id)
            for k, seg in enumerate(segments):
                inputs[r, k, :len(seg)], mask[r, k, :len(seg)] = seg, 1
            labels[r], filled[r] = int(label), len(segments)
            if self.has_tasks:
                tasks[r] = int(row["task"])
        self._cache = ((epoch, batch), (inputs, mask, labels, filled, tasks))
        return inputs, mask, labels, filled, tasks

    def batch_at(self, epoch: int, step: int) -> StreamBatch:
        """Step `step` of epoch `epoch` (no state change)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside the epoch's {self.steps_per_epoch} steps")
        batch, k = divmod(step, self.max_segments)
        inputs, mask, labels, filled, tasks = self._rows(epoch, batch)
        b = len(self.stream_ids)
        inside = k < filled  # (B,) the row's document reaches this segment
        return StreamBatch(
            input_ids=torch.from_numpy(inputs[:, k].copy()),
            targets=torch.full((b, self.segment_length), IGNORE_INDEX, dtype=torch.int64),
            attention_mask=torch.from_numpy(mask[:, k].copy()),
            doc_start=torch.full((b,), k == 0, dtype=torch.bool),
            doc_start_pos=torch.full((b,), 0 if k == 0 else -1, dtype=torch.int64),
            stream_ids=torch.tensor(list(self.stream_ids), dtype=torch.int64),
            epoch=epoch,
            step=step,
            global_step=epoch * self.steps_per_epoch + step,
            labels=torch.from_numpy(np.where(inside, labels, IGNORE_INDEX)),
            last=torch.from_numpy(filled == k + 1),
            tasks=torch.from_numpy(tasks.copy()) if self.has_tasks else None,
        )

    def task_end_steps(self, bptt_segments: int, total_steps: int) -> list[int]:
        """The training steps after which a task's last document has been read (documents in order: a
        lifelong run's tasks in turn), every epoch, up to `total_steps`: where the forgetting curve is read.
        A task ends where the next document's task differs, and at the epoch's end; the step is the one
        that completes the batch holding that document (a batch may hold the next task's first documents).

        Raises:
            ValueError: the documents are shuffled, or have no `task` column.
        """
        if self.shuffle or not self.has_tasks:
            raise ValueError("task ends need the documents in order (shuffle off) and a `task` column")
        tasks = np.asarray(self.dataset["task"])[: self.num_batches * self.batch_size]  # (drop_last: the rest unread)
        last = np.flatnonzero(tasks[1:] != tasks[:-1]).tolist() + [len(tasks) - 1]  # each task's last document
        ends: set[int] = set()
        for epoch in range(math.ceil(total_steps * bptt_segments / self.steps_per_epoch)):
            for p in last:
                segments = epoch * self.steps_per_epoch + (p // self.batch_size + 1) * self.segments_per_example
                ends.add(math.ceil(segments / bptt_segments))
        return sorted(e for e in ends if e <= total_steps)

    def has_targets(self, step: int) -> bool:
        """Every segment of a batch may hold labelled rows."""
        return True

    def count_target_steps(self, steps: int) -> int:
        return steps

    def state_dict(self) -> dict[str, Any]:
        """Position and layout (JSON-serialisable)."""
        state = super().state_dict()
        state.update(format=_STATE_FORMAT, dataset_fingerprint=self.fingerprint, max_segments=self.max_segments,
                     cls_id=self.cls_id, sep_id=self.sep_id)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` output, saved with any world size.

        Raises:
            ValueError: the state belongs to other data or another layout.
        """
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not a document-stream state (format {state.get('format')!r})")
        mine = self.state_dict()
        for key in ("max_segments", "cls_id", "sep_id"):
            if state.get(key) != mine[key]:
                raise ValueError(f"document-stream state has {key} = {state.get(key)!r}, these streams {mine[key]!r}")
        super().load_state_dict({**state, "format": super().state_dict()["format"]})


__all__ = ["DocumentStreams", "document_segments"]
