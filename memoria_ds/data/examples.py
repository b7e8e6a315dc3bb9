"""ExampleStreams: fixed-length examples (the sorting task) read segment by segment.

Notation: E examples of T_ex tokens each, B = B_global rows, w ranks, L segment length,
K = ceil(T_ex / L) segments per example.

Batch i of an epoch is examples `order[i B : (i + 1) B]` (`order` is a seeded per-epoch
permutation when `shuffle`, else 0..E-1); its K segments are steps `i K .. i K + K - 1`.
Every row's `doc_start` is set at the first segment of each batch (a new example starts;
memory must be reset there, see ResetPolicy(at_document_start=True)). Rank r owns rows
[r B / w, (r + 1) B / w) of every batch. A last, partial batch is dropped (`drop_last`)
or filled with padding rows whose targets are all -100 (the default, so an evaluation
scores every example exactly once). The batches have the `StreamBatch` form of
streams.py, so a training loop and the evaluation treat both the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import datasets
import numpy as np
import torch

from memoria_ds.data.batch import IGNORE_INDEX, StreamBatch
from memoria_ds.data.cursor import EpochCursor
from memoria_ds.data.sorting import sorting_sequence

_STATE_FORMAT = "memoria_ds.example_streams/1"
_LAYOUT_KEYS = ("num_examples", "example_length", "batch_size", "segment_length", "shuffle", "seed", "drop_last",
                "dataset_fingerprint")
Transform = Callable[[dict[str, Any]], "tuple[np.ndarray, np.ndarray]"]


def _sorting_transform(row: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    return sorting_sequence(np.asarray(row["symbols"]), np.asarray(row["target"]))


def _aligned_transform(row: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(row["input_ids"], np.int64), np.asarray(row["targets"], np.int64)


class ExampleStreams(EpochCursor):
    """Examples of one length, B_global at a time, fed as consecutive segments.

    Args:
        dataset: rows with `symbols` / `target` (the sorting task, `generate_sorting`), or
            with aligned `input_ids` / `targets`, or anything `transform` reads.
        batch_size: B_global, rows per batch over all ranks (a multiple of `world_size`).
        segment_length: L.
        rank, world_size: this process's data-parallel coordinates.
        shuffle: a new seeded example order every epoch.
        seed: the shuffle seed.
        drop_last: drop the last partial batch instead of padding it.
        pad_id: input id of padding rows.
        transform: row -> (input_ids (T_ex,), aligned targets (T_ex,)).
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        *,
        batch_size: int,
        segment_length: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        pad_id: int = 0,
        transform: Transform | None = None,
    ) -> None:
        self._set_layout(dataset, batch_size, segment_length, rank, world_size, shuffle, seed, drop_last, pad_id)
        self.transform = transform or (_sorting_transform if "symbols" in dataset.column_names else _aligned_transform)
        first_inputs, first_targets = self.transform(dataset[0])
        self.example_length = len(first_inputs)
        self.segments_per_example = math.ceil(self.example_length / segment_length)
        # The segments of an example that hold targets (the sorting task: its answer, in the
        # last one). Every example must share this layout (checked as batches are built): the
        # training loop runs the other segments forward only, to write the memory.
        scored = np.flatnonzero(np.asarray(first_targets) != IGNORE_INDEX) // segment_length
        self.scored_segments = frozenset(int(k) for k in np.unique(scored))

    def _set_layout(self, dataset: datasets.Dataset, batch_size: int, segment_length: int, rank: int,
                    world_size: int, shuffle: bool, seed: int, drop_last: bool, pad_id: int) -> None:
        """Check and keep what every kind of example stream shares: the batch over ranks, this rank's
        rows (`stream_ids`), the order's seed, the number of batches, the cursor at the start.

        Raises:
            ValueError: a batch that does not split over the ranks, an empty dataset, no full batch.
        """
        if batch_size < 1 or segment_length < 1:
            raise ValueError(f"`batch_size` ({batch_size}) and `segment_length` ({segment_length}) must be >= 1")
        if batch_size % world_size or not 0 <= rank < world_size:
            raise ValueError(
                f"`batch_size` (B_global = {batch_size}) must be a multiple of the world size ({world_size}) "
                f"and rank {rank} in range: each rank owns B_global / world_size rows"
            )
        n = len(dataset)
        if n == 0:
            raise ValueError("the dataset is empty")
        self.dataset = dataset
        self.batch_size, self.segment_length = batch_size, segment_length
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.drop_last, self.pad_id = shuffle, seed, drop_last, pad_id
        per = batch_size // world_size
        self.stream_ids = range(rank * per, (rank + 1) * per)
        self.num_batches = n // batch_size if drop_last else math.ceil(n / batch_size)
        if self.num_batches == 0:
            raise ValueError(f"{n} examples make no full batch of {batch_size}; use drop_last=False or a smaller batch")
        self._epoch, self._step = 0, 0
        self._cache: tuple[tuple[int, int], tuple[np.ndarray, ...]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_batches * self.segments_per_example

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def _rows(self, epoch: int, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(B_local, K L) inputs and targets of this rank's rows of a batch, and which rows are real."""
        if self._cache is not None and self._cache[0] == (epoch, batch):
            return self._cache[1]
        order = self._order(epoch)
        width = self.segments_per_example * self.segment_length
        rows = len(self.stream_ids)
        inputs = np.full((rows, width), self.pad_id, dtype=np.int64)
        targets = np.full((rows, width), IGNORE_INDEX, dtype=np.int64)
        real = np.zeros(rows, dtype=bool)
        for r, slot in enumerate(self.stream_ids):
            j = batch * self.batch_size + slot
            if j >= len(order):
                continue
            x, y = self.transform(self.dataset[int(order[j])])
            if len(x) != self.example_length or len(y) != self.example_length:
                raise ValueError(
                    f"example {int(order[j])} has {len(x)} tokens, the first had {self.example_length}; "
                    "ExampleStreams needs examples of one length"
                )
            inputs[r, : len(x)], targets[r, : len(y)], real[r] = x, y, True
        segments = (targets != IGNORE_INDEX).reshape(rows, self.segments_per_example, -1).any(axis=(0, 2))
        if set(np.flatnonzero(segments).tolist()) - self.scored_segments:
            raise ValueError(
                f"batch {batch} has targets in segments {sorted(np.flatnonzero(segments).tolist())}, the first example "
                f"only in {sorted(self.scored_segments)}; ExampleStreams needs examples of one layout"
            )
        self._cache = ((epoch, batch), (inputs, targets, real))
        return inputs, targets, real

    def has_targets(self, step: int) -> bool:
        """Whether step `step` of an epoch feeds a segment that holds targets."""
        return step % self.segments_per_example in self.scored_segments

    def count_target_steps(self, steps: int) -> int:
        """How many of the first `steps` steps (epochs wrap) feed a segment that holds targets."""
        per_epoch = self.num_batches * len(self.scored_segments)
        full, rest = divmod(steps, self.steps_per_epoch)
        return full * per_epoch + sum(self.has_targets(s) for s in range(rest))

    def batch_at(self, epoch: int, step: int) -> StreamBatch:
        """Step `step` of epoch `epoch` (no state change)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside the epoch's {self.steps_per_epoch} steps")
        batch, k = divmod(step, self.segments_per_example)
        inputs, targets, real = self._rows(epoch, batch)
        cols = slice(k * self.segment_length, (k + 1) * self.segment_length)
        valid = np.clip(self.example_length - k * self.segment_length, 0, self.segment_length)
        mask = np.zeros((len(self.stream_ids), self.segment_length), dtype=np.int64)
        mask[real, :valid] = 1
        b = len(self.stream_ids)
        return StreamBatch(
            input_ids=torch.from_numpy(inputs[:, cols].copy()),
            targets=torch.from_numpy(targets[:, cols].copy()),
            attention_mask=torch.from_numpy(mask),
            doc_start=torch.full((b,), k == 0, dtype=torch.bool),
            doc_start_pos=torch.full((b,), 0 if k == 0 else -1, dtype=torch.int64),
            stream_ids=torch.tensor(list(self.stream_ids), dtype=torch.int64),
            epoch=epoch,
            step=step,
            global_step=epoch * self.steps_per_epoch + step,
        )

    def state_dict(self) -> dict[str, Any]:
        """Position and layout (JSON-serialisable)."""
        self._normalise()
        return {
            "format": _STATE_FORMAT, "epoch": self._epoch, "step": self._step,
            "num_examples": len(self.dataset), "example_length": self.example_length,
            "batch_size": self.batch_size, "segment_length": self.segment_length, "shuffle": self.shuffle,
            "seed": self.seed, "drop_last": self.drop_last,
            "dataset_fingerprint": getattr(self.dataset, "_fingerprint", ""),
            "saved_world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` output, saved with any world size.

        Raises:
            ValueError: the state belongs to other data or another layout.
        """
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not an example-stream state (format {state.get('format')!r})")
        mine = self.state_dict()
        for key in _LAYOUT_KEYS:
            if state.get(key) != mine[key]:
                raise ValueError(f"example-stream state has {key} = {state.get(key)!r}, these streams {mine[key]!r}")
        if not 0 <= int(state["step"]) <= self.steps_per_epoch:
            raise ValueError(f"step {state['step']} is outside the epoch")
        self.set_position(int(state["epoch"]), int(state["step"]))
