"""Contiguous token streams (Transformer-XL layout), rank slices, document flags, resume.

Notation: N tokens in the split, B = B_global streams, w data-parallel ranks, L segment
length, T steps (segments) per epoch.

Layout. The split's documents are concatenated in order (optionally in a per-epoch
shuffled document order) into one sequence of N tokens, and cut into B contiguous
streams of as equal length as possible: stream s holds tokens
[starts[s], starts[s + 1]) with starts[s] = s * (N // B) + min(s, N % B), so the first
N % B streams hold one token more. Step t feeds segment t, tokens
[starts[s] + t L, starts[s] + (t + 1) L), of every stream at once.

Targets. The target of a position is the next token of the *whole* sequence, so the last
token of stream s predicts the first token of stream s + 1 (with stream s's context).
Every token but the very first of the split is therefore a target exactly once, whatever
B is: N - 1 scored tokens under the `full` protocol for any number of streams.

The tail (`tail`): with "pad" (the default) T = ceil(max stream length / L) and the
segments past a stream's end are padded (`pad_id` in, -100 targets): nothing is dropped.
With "drop", T = min stream length // L: every segment is full, and the remainder of
each stream (< L tokens, plus at most one) is not fed that epoch (Transformer-XL's and the
authors' behaviour); the first dropped token is still scored as the target of the last
fed one.

Ranks. B must be a multiple of w; rank r owns streams [r B / w, (r + 1) B / w), which are
also the memory rows it owns. The layout depends on N, B, L and the tail only, never on
w, so a checkpoint taken with one world size resumes on another with every stream at the
same position (re-sharding by global stream id).

Epochs: every epoch reads the same streams from their starts (and resets memory at the
first step, see reset.py); with `shuffle_documents` the document order, not the stream
cut points, changes from epoch to epoch (seeded by `seed` and the epoch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from memoria_ds.data.batch import IGNORE_INDEX, StreamBatch
from memoria_ds.data.cursor import EpochCursor
from memoria_ds.data.token_corpus import TokenCorpus

Tail = Literal["pad", "drop"]
_STATE_FORMAT = "memoria_ds.token_streams/1"
# Keys of the state that must match for a state to be loaded into these streams.
_LAYOUT_KEYS = ("num_streams", "segment_length", "tail", "num_tokens", "num_documents",
                "corpus_fingerprint", "shuffle_documents", "seed")


@dataclass(frozen=True)
class StreamLayout:
    """The arithmetic of B contiguous streams over N tokens, cut into L-token segments.

    Raises:
        ValueError: too few tokens for the streams, or (tail "drop") for one segment each.
    """

    num_tokens: int
    num_streams: int
    segment_length: int
    tail: Tail = "pad"

    def __post_init__(self) -> None:
        if self.num_streams < 1 or self.segment_length < 1:
            raise ValueError(
                f"`num_streams` ({self.num_streams}) and `segment_length` ({self.segment_length}) must be >= 1"
            )
        if self.tail not in ("pad", "drop"):
            raise ValueError(f"`tail` must be 'pad' or 'drop', got {self.tail!r}")
        if self.num_tokens < self.num_streams:
            raise ValueError(
                f"{self.num_tokens} tokens cannot fill {self.num_streams} streams; use fewer streams"
            )
        if self.tail == "drop" and self.num_tokens // self.num_streams < self.segment_length:
            raise ValueError(
                f"with tail='drop' every stream needs one full segment: {self.num_tokens} tokens / "
                f"{self.num_streams} streams < segment length {self.segment_length}; use tail='pad', "
                "fewer streams or shorter segments"
            )

    @property
    def starts(self) -> np.ndarray:
        """(B + 1,) int64: stream s is tokens [starts[s], starts[s + 1])."""
        q, r = divmod(self.num_tokens, self.num_streams)
        s = np.arange(self.num_streams + 1, dtype=np.int64)
        return s * q + np.minimum(s, r)

    @property
    def steps_per_epoch(self) -> int:
        q, r = divmod(self.num_tokens, self.num_streams)
        if self.tail == "drop":
            return q // self.segment_length
        return math.ceil((q + (1 if r else 0)) / self.segment_length)

    def rank_streams(self, rank: int, world_size: int) -> range:
        """Global ids of the streams rank `rank` of `world_size` owns."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if self.num_streams % world_size:
            raise ValueError(
                f"the number of streams (B_global = {self.num_streams}) must be a multiple of the "
                f"data-parallel world size ({world_size}): each rank owns B_global / world_size streams "
                f"and their memory rows; use e.g. B_global = {world_size * max(1, self.num_streams // world_size)}"
            )
        per = self.num_streams // world_size
        return range(rank * per, (rank + 1) * per)


class _EpochOrder:
    """The documents of one epoch in reading order, as a virtual flat sequence."""

    def __init__(self, corpus: TokenCorpus, perm: np.ndarray | None) -> None:
        self.corpus = corpus
        self.perm = perm
        lengths = corpus.doc_lengths if perm is None else corpus.doc_lengths[perm]
        self.vstarts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # (D + 1,)

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens at virtual positions [a, b)."""
        tokens = self.corpus.tokens
        if self.perm is None:
            return np.asarray(tokens[a:b])
        d = int(np.searchsorted(self.vstarts, a, side="right")) - 1
        parts = []
        while a < b:
            src = self.corpus.doc_offsets[self.perm[d]]
            end = min(b, int(self.vstarts[d + 1]))
            parts.append(np.asarray(tokens[src + a - self.vstarts[d] : src + end - self.vstarts[d]]))
            a, d = end, d + 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=tokens.dtype)

    def doc_index(self, pos: int) -> int:
        """Index (in this epoch's order) of the document holding virtual position `pos`."""
        return int(np.searchsorted(self.vstarts, pos, side="right")) - 1

    def first_doc_start_in(self, a: int, b: int) -> int:
        """The first document start in [a, b), or -1."""
        k = int(np.searchsorted(self.vstarts[:-1], a, side="left"))
        if k < self.vstarts.size - 1 and self.vstarts[k] < b:
            return int(self.vstarts[k])
        return -1


class TokenStreams(EpochCursor):
    """B_global contiguous streams of a `TokenCorpus`, as seen by one data-parallel rank.

    Iterating yields the remaining `StreamBatch`es of the current epoch and then moves to
    the next epoch; `state_dict()` taken after receiving the batch of step k resumes at
    step k + 1. `batch_at(epoch, step)` is random access and changes nothing.

    Args:
        corpus: the tokenized split.
        num_streams: B_global, the number of streams over all ranks.
        segment_length: L, tokens per segment.
        rank: this process's data-parallel rank.
        world_size: the data-parallel world size; `num_streams` must be a multiple of it.
        tail: "pad" (default, nothing dropped) or "drop" (full segments only).
        shuffle_documents: read the documents in a new seeded order every epoch.
        seed: the shuffle seed.
        pad_id: input id used for padding past a stream's end (its targets are -100).
    """

    def __init__(
        self,
        corpus: TokenCorpus,
        *,
        num_streams: int,
        segment_length: int,
        rank: int = 0,
        world_size: int = 1,
        tail: Tail = "pad",
        shuffle_documents: bool = False,
        seed: int = 0,
        pad_id: int = 0,
    ) -> None:
        self.corpus = corpus
        self.layout = StreamLayout(corpus.num_tokens, num_streams, segment_length, tail)
        self.stream_ids = self.layout.rank_streams(rank, world_size)
        self.rank, self.world_size = rank, world_size
        self.shuffle_documents, self.seed, self.pad_id = shuffle_documents, seed, pad_id
        self._starts = self.layout.starts
        self._epoch, self._step = 0, 0
        self._order: tuple[int, _EpochOrder] | None = None

    # ------------------------------------------------------------------ layout

    @property
    def num_streams(self) -> int:
        return self.layout.num_streams

    @property
    def segment_length(self) -> int:
        return self.layout.segment_length

    @property
    def steps_per_epoch(self) -> int:
        return self.layout.steps_per_epoch

    def _epoch_order(self, epoch: int) -> _EpochOrder:
        if self._order is None or self._order[0] != epoch:
            perm = None
            if self.shuffle_documents:
                rng = np.random.default_rng([self.seed, epoch])
                perm = rng.permutation(self.corpus.num_documents)
            self._order = (epoch, _EpochOrder(self.corpus, perm))
        return self._order[1]

    # ------------------------------------------------------------------ batches

    def has_targets(self, step: int) -> bool:
        """Every segment of running text is scored (the same question `ExampleStreams` answers)."""
        return True

    def count_target_steps(self, steps: int) -> int:
        """How many of the first `steps` steps feed a scored segment: all of them."""
        return steps

    def batch_at(self, epoch: int, step: int) -> StreamBatch:
        """Segment `step` of epoch `epoch` of this rank's streams (no state change)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside the epoch's {self.steps_per_epoch} steps")
        order = self._epoch_order(epoch)
        n_total, seg = self.corpus.num_tokens, self.segment_length
        b = len(self.stream_ids)
        input_ids = np.full((b, seg), self.pad_id, dtype=np.int64)
        targets = np.full((b, seg), IGNORE_INDEX, dtype=np.int64)
        doc_start = np.zeros(b, dtype=bool)
        doc_start_pos = np.full(b, -1, dtype=np.int64)
        attention_mask = np.zeros((b, seg), dtype=np.int64)
        for row, s in enumerate(self.stream_ids):
            p0 = int(self._starts[s]) + step * seg
            end = min(p0 + seg, int(self._starts[s + 1])) if self.layout.tail == "pad" else p0 + seg
            n = max(0, end - p0)
            if n:
                window = order.read(p0, min(end + 1, n_total))  # inputs plus the next token
                input_ids[row, :n] = window[:n]
                attention_mask[row, :n] = 1
                targets[row, : window.size - 1] = window[1:]
                first = order.first_doc_start_in(p0, end)
                doc_start_pos[row] = first - p0 if first >= 0 else -1
            doc_start[row] = step == 0 or (
                n > 0 and order.doc_index(p0) != order.doc_index(p0 - seg)
            )
        return StreamBatch(
            input_ids=torch.from_numpy(input_ids),
            targets=torch.from_numpy(targets),
            attention_mask=torch.from_numpy(attention_mask),
            doc_start=torch.from_numpy(doc_start),
            doc_start_pos=torch.from_numpy(doc_start_pos),
            stream_ids=torch.tensor(list(self.stream_ids), dtype=torch.int64),
            epoch=epoch,
            step=step,
            global_step=epoch * self.steps_per_epoch + step,
        )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Every stream's position and the layout it belongs to (JSON-serialisable)."""
        self._normalise()
        positions = (self._starts[:-1] + self._step * self.segment_length).tolist()
        return {
            "format": _STATE_FORMAT,
            "epoch": self._epoch,
            "step": self._step,
            "num_streams": self.num_streams,
            "segment_length": self.segment_length,
            "tail": self.layout.tail,
            "num_tokens": self.corpus.num_tokens,
            "num_documents": self.corpus.num_documents,
            "corpus_fingerprint": self.corpus.fingerprint,
            "shuffle_documents": self.shuffle_documents,
            "seed": self.seed,
            "stream_positions": [int(p) for p in positions],
            "saved_world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` output, saved with any world size.

        Raises:
            ValueError: the state belongs to another layout or corpus (the message names
                the field that differs), or its stream positions are inconsistent.
        """
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not a token-stream state (format {state.get('format')!r}, expected {_STATE_FORMAT!r})")
        mine = self.state_dict()
        for key in _LAYOUT_KEYS:
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"stream state has {key} = {state.get(key)!r} but these streams have {mine[key]!r}; "
                    "resume with the same corpus, number of streams, segment length, tail and shuffling"
                )
        expected = (self._starts[:-1] + int(state["step"]) * self.segment_length).tolist()
        if list(state["stream_positions"]) != expected:
            raise ValueError("stream state's `stream_positions` do not match its step; the state is corrupt")
        self.set_position(int(state["epoch"]), int(state["step"]))
