"""TokenCorpus: a tokenized split as one flat token array plus document offsets.

A split of `D` documents with `N` tokens in all is held as

    tokens       (N,)     uint8 / uint16 / int32 (the smallest that holds the vocabulary)
    doc_offsets  (D + 1,) int64: document d is tokens[doc_offsets[d]:doc_offsets[d + 1]]

so that laying it out as streams (streams.py) is pure index arithmetic. Built from a
tokenized `datasets.Dataset` (one row per document, a list-of-ints column), it is written
once as two `.npy` files next to the dataset's Arrow cache and memory-mapped afterwards:
every data-parallel rank on a node then shares one copy in the page cache (nanoGPT's
`train.bin` idea), and a 100M-token corpus costs no per-rank RAM.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.compute as pc

# Bump when the on-disk layout of the cached arrays changes.
_CACHE_VERSION = 1


def _smallest_dtype(max_token: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16, np.int32):
        if max_token <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"token id {max_token} does not fit in int32; no tokenizer is that large")


@dataclass
class TokenCorpus:
    """One tokenized split: a flat token array and where each document starts.

    Args:
        tokens: (N,) integer token ids, all documents concatenated in order (any
            separator token is already part of the documents, see `tokenize.py`).
        doc_offsets: (D + 1,) int64, `doc_offsets[0] == 0`, `doc_offsets[-1] == N`,
            non-decreasing. Empty documents are allowed (they start nowhere).
        fingerprint: identifies the content; stream checkpoints refuse a corpus whose
            fingerprint differs from the one they were saved with.
        metadata: JSON-able facts about the data, copied into every evaluation result
            (corpus name, split, tokenizer, separator, `unit`: "token" or "character").

    Raises:
        ValueError: offsets that do not describe `tokens`.
    """

    tokens: np.ndarray
    doc_offsets: np.ndarray
    fingerprint: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1:
            raise ValueError(f"`tokens` must be 1-D, got shape {self.tokens.shape}")
        offsets = np.asarray(self.doc_offsets, dtype=np.int64)
        if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != self.tokens.size:
            raise ValueError(
                f"`doc_offsets` must start at 0 and end at len(tokens) = {self.tokens.size}; "
                f"got {offsets[:3]} ... {offsets[-3:]}"
            )
        if np.any(np.diff(offsets) < 0):
            raise ValueError("`doc_offsets` must be non-decreasing")
        self.doc_offsets = offsets
        if not self.fingerprint:
            self.fingerprint = self._content_hash()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_token_lists(
        cls, documents: Sequence[Sequence[int]], *, metadata: dict[str, Any] | None = None
    ) -> "TokenCorpus":
        """A corpus from Python lists (tests, small data). One list per document."""
        lengths = np.array([len(d) for d in documents], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = [t for d in documents for t in d]
        if any(t < 0 for t in flat):
            raise ValueError("token ids must be non-negative")
        dtype = _smallest_dtype(max(flat, default=0))
        return cls(np.asarray(flat, dtype=dtype), offsets, metadata=dict(metadata or {}))

    @classmethod
    def from_dataset(
        cls,
        dataset: Any,
        *,
        column: str = "input_ids",
        cache_dir: str | os.PathLike | None = None,
        metadata: dict[str, Any] | None = None,
        batch_size: int = 1024,
    ) -> "TokenCorpus":
        """Flatten a tokenized `datasets.Dataset` (one row per document, in row order).

        Args:
            dataset: a `datasets.Dataset` with a list-of-ints column (`tokenize_documents`
                makes one). Selections and shuffles (index mappings) are respected.
            column: the token column.
            cache_dir: where to write `tokens` and `doc_offsets` as `.npy` files that are
                memory-mapped from then on. Default: next to the dataset's own Arrow cache
                files; an in-memory dataset is flattened in memory.
            metadata: copied into `TokenCorpus.metadata` (and into evaluation results).
            batch_size: rows read at a time.

        Returns:
            The corpus; its fingerprint is the dataset's fingerprint and the column name.
        """
        if column not in dataset.column_names:
            raise ValueError(
                f"the dataset has no column {column!r} (columns: {dataset.column_names}); "
                "tokenize it first with memoria_ds.data.tokenize_documents"
            )
        fingerprint = hashlib.sha256(
            f"{getattr(dataset, '_fingerprint', '')}|{column}|v{_CACHE_VERSION}".encode()
        ).hexdigest()[:16]
        if cache_dir is None and getattr(dataset, "cache_files", None):
            cache_dir = os.path.dirname(dataset.cache_files[0]["filename"])
        meta = dict(metadata or {})
        if cache_dir is not None:
            tok_path = os.path.join(cache_dir, f"memoria_tokens_{fingerprint}.npy")
            off_path = os.path.join(cache_dir, f"memoria_doc_offsets_{fingerprint}.npy")
            if os.path.exists(tok_path) and os.path.exists(off_path):
                return cls(np.load(tok_path, mmap_mode="r"), np.load(off_path), fingerprint, meta)

        arrow = dataset.with_format("arrow")
        lengths, max_token = [], 0
        for table in arrow.iter(batch_size=batch_size):
            col = table.column(column)
            # A null row counts as an empty document.
            lengths.append(np.asarray(pc.fill_null(pc.list_value_length(col), 0)))
            values = pc.list_flatten(col)
            if len(values):
                max_token = max(max_token, int(pc.max(values).as_py()))
                if int(pc.min(values).as_py()) < 0:
                    raise ValueError(f"column {column!r} holds negative token ids")
        lengths_np = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths_np)]).astype(np.int64)
        dtype = _smallest_dtype(max_token)

        if cache_dir is None:
            tokens = np.empty(int(offsets[-1]), dtype=dtype)
        else:
            os.makedirs(cache_dir, exist_ok=True)
            fd, tmp_tok = tempfile.mkstemp(dir=cache_dir, suffix=".npy.tmp")
            os.close(fd)
            tokens = np.lib.format.open_memmap(tmp_tok, mode="w+", dtype=dtype, shape=(int(offsets[-1]),))
        pos = 0
        for table in arrow.iter(batch_size=batch_size):
            chunk = np.asarray(pc.list_flatten(table.column(column)))
            tokens[pos : pos + chunk.size] = chunk
            pos += chunk.size
        assert pos == offsets[-1], "the dataset changed while it was read"
        if cache_dir is None:
            return cls(tokens, offsets, fingerprint, meta)
        tokens.flush()
        del tokens
        # Atomic publish: concurrent ranks may race to build the same cache; each renames
        # its own complete file, so a reader never sees a half-written one.
        fd, tmp_off = tempfile.mkstemp(dir=cache_dir, suffix=".npy.tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, offsets)
        os.replace(tmp_tok, tok_path)
        os.replace(tmp_off, off_path)
        return cls(np.load(tok_path, mmap_mode="r"), np.load(off_path), fingerprint, meta)

    # ------------------------------------------------------------------ queries

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def num_documents(self) -> int:
        return int(self.doc_offsets.size - 1)

    @property
    def doc_lengths(self) -> np.ndarray:
        """(D,) int64 tokens per document."""
        return np.diff(self.doc_offsets)

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index`."""
        return np.asarray(self.tokens[self.doc_offsets[index] : self.doc_offsets[index + 1]])

    def truncate_documents(self, multiple: int) -> "TokenCorpus":
        """Cut every document down to a multiple of `multiple` tokens (shorter ones vanish).

        This is what the authors' data pipeline did (each article chunked into 150-token
        segments, the remainder dropped), so a corpus truncated with the segment length
        and read with the `paper` protocol reproduces their evaluation exactly.
        """
        if multiple < 1:
            raise ValueError(f"`multiple` must be >= 1, got {multiple}")
        lengths = self.doc_lengths // multiple * multiple
        keep = np.concatenate(
            [np.arange(s, s + n, dtype=np.int64) for s, n in zip(self.doc_offsets[:-1], lengths)]
            or [np.zeros(0, np.int64)]
        )
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        meta = dict(self.metadata, documents_truncated_to_multiple_of=multiple)
        fp = hashlib.sha256(f"{self.fingerprint}|truncate{multiple}".encode()).hexdigest()[:16]
        return TokenCorpus(np.asarray(self.tokens[keep]), offsets, fp, meta)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for results and logs."""
        return {
            **self.metadata,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "fingerprint": self.fingerprint,
        }

    def _content_hash(self) -> str:
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.doc_offsets).tobytes())
        h.update(np.ascontiguousarray(self.tokens).astype(np.int64).tobytes())
        return h.hexdigest()[:16]
