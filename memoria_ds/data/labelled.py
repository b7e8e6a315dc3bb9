"""Labelled documents for classification: local files or a hub dataset, tokenized, labels as indices.

    docs = load_labelled_documents(files={"train": ["a.jsonl"], "validation": ["b.jsonl"]},
                                   tokenizer="bert-base-uncased", splits=("train", "validation"))
    docs["train"].dataset        # columns input_ids (no special tokens) and label (0 .. K-1)
    docs["train"].label_names    # index -> name, shared by every split

Labels are read from `label_field`: a `ClassLabel` feature keeps its names and order; integers
are indices (names "0", "1", ...); strings are mapped to indices in sorted order over every
split loaded, so that a label means the same class in each. A tokenizer's `cls_token_id` and
`sep_token_id` (BERT's [CLS] / [SEP], RoBERTa's <s> / </s>) are what `DocumentStreams` puts
around each segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np

from memoria_ds.data.corpora import local_documents
from memoria_ds.data.tokenize import gpt2_tokenizer_offline, load_tokenizer, tokenizer_fingerprint


@dataclass
class LabelledDocuments:
    """One split of labelled documents and what the model needs to read them.

    Attributes:
        dataset: columns `input_ids` (int64 lists, no special tokens) and `label` (class indices); `task`
            (ints) when the source has that column (a lifelong run's tasks).
        label_names: the classes, index -> name (every split the same).
        cls_id / sep_id / pad_id: the tokenizer's tokens around each segment and its padding (or None).
        vocab_size: the tokenizer's vocabulary (a from-scratch model's).
        metadata: tokenizer facts recorded with results.
    """

    dataset: datasets.Dataset
    label_names: list[str]
    cls_id: int | None
    sep_id: int | None
    pad_id: int
    vocab_size: int
    metadata: dict[str, Any]

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @property
    def num_documents(self) -> int:
        return len(self.dataset)


def _label_names(splits: dict[str, datasets.Dataset], field: str,
                 known: list[str] | None = None) -> tuple[list[str], Any]:
    """(names, value -> index) of the labels of every split; with `known` (a trained model's classes),
    names are looked up among them, so that a split without some class maps as training did."""
    feature = next(iter(splits.values())).features[field]
    if known is None and isinstance(feature, datasets.ClassLabel):
        return list(feature.names), int
    values = set()
    for ds in splits.values():
        values.update(ds[field])
    if not values:
        raise ValueError(f"the splits {sorted(splits)} hold no document")
    if all(isinstance(v, str) for v in values):
        names = list(known) if known is not None else sorted(values)
        index = {name: i for i, name in enumerate(names)}
        unknown = sorted(values - set(index))
        if unknown:
            raise ValueError(f"labels {unknown[:5]} in `{field}` are not among the model's classes {names}")
        return names, index.__getitem__
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        kinds = sorted({type(v).__name__ for v in values})
        raise ValueError(f"the labels in `{field}` are {kinds}: give class indices (int) or class names (str)")
    count = len(known) if known is not None else max(values) + 1
    if min(values) < 0 or max(values) >= count:
        raise ValueError(f"the labels in `{field}` must be class indices 0..{count - 1}"
                         + (f" (the model's {count} classes)" if known is not None else ""))
    return (list(known) if known is not None else [str(i) for i in range(count)]), int


def load_labelled_documents(*, files: dict[str, list[str]] | None = None, path: str | None = None,
                            tokenizer: str | None = None, splits: tuple[str, ...] = ("train",),
                            text_field: str = "text", label_field: str = "label", num_proc: int | None = None,
                            label_names: list[str] | None = None) -> dict[str, LabelledDocuments]:
    """Tokenized labelled documents of `splits`.

    Args:
        files: `{split: [paths]}` (json(l), parquet, csv: one document per row).
        path: a hub dataset name, or a `save_to_disk` folder (when `files` is not given); `hyperpartisan`:
            the paper's Table 3 data in the authors' splits (`memoria_ds/data/hyperpartisan.py`).
        tokenizer: a tokenizer name or directory (the backbone's, BERT's or RoBERTa's); None: GPT-2's
            (shipped, for from-scratch models).
        splits: the splits to load (each must exist).
        label_names: a trained model's classes (index -> name) to map the labels by; None: from the data.

    Raises:
        ValueError: a missing split or column, labels that are neither indices nor names.
    """
    if files:
        raw = local_documents({k: v for k, v in files.items() if k in splits}, text_field=text_field)
        text_field = "text"
    elif path == "hyperpartisan":  # the paper's Table 3 data, split as the authors split it
        from memoria_ds.data.hyperpartisan import load_hyperpartisan

        raw = load_hyperpartisan()
    elif path is not None:
        try:
            raw = datasets.load_from_disk(path)
        except (FileNotFoundError, ValueError):
            raw = datasets.load_dataset(path)
    else:
        raise ValueError("labelled documents need `files` or `path`")
    missing = [s for s in splits if s not in raw]
    if missing:
        raise ValueError(f"the documents have no split {missing[0]!r} (they have {sorted(raw)})")
    chosen = {s: raw[s] for s in splits}
    for split, ds in chosen.items():
        lacking = [c for c in (text_field, label_field) if c not in ds.column_names]
        if lacking:
            raise ValueError(f"split {split!r} has no column {lacking[0]!r} (it has {ds.column_names}); set "
                             f"data.text_field / data.label_field")
    names, to_index = _label_names(chosen, label_field, label_names)
    tok = gpt2_tokenizer_offline() if tokenizer is None else load_tokenizer(tokenizer)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids = tok(batch[text_field], add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        out = {"input_ids": ids, "label": [to_index(v) for v in batch[label_field]]}
        if "task" in batch:  # a lifelong run's task of each document (an int), kept for the per-task readings
            out["task"] = [int(t) for t in batch["task"]]
        return out

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    meta = {"tokenizer": getattr(tok, "name_or_path", type(tok).__name__), "vocab_size": len(tok),
            "tokenizer_fingerprint": tokenizer_fingerprint(tok), "label_names": names}
    out = {}
    for split, ds in chosen.items():
        encoded = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=num_proc,
                         desc=f"tokenizing {split}")
        encoded = encoded.cast_column("label", datasets.Value("int64"))
        out[split] = LabelledDocuments(encoded, names, tok.cls_token_id, tok.sep_token_id, int(pad), len(tok), meta)
    return out


__all__ = ["LabelledDocuments", "load_labelled_documents"]
