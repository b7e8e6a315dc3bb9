"""The evidence-documents task (memoria_ds/data/evidence_documents.py): its class is told once, by a
word the book never uses, in the first part of a passage of the bundled book, so that the
document's last segment never holds it; splits from disjoint parts of the book; reproducible."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from memoria_ds.data.documents import document_segments
from memoria_ds.data.evidence_documents import (CUES, SPLIT_SPANS, book_words, write_book_tokenizer,
                                                 write_evidence_documents)
from memoria_ds.data.labelled import load_labelled_documents


def _rows(files, split):
    return [json.loads(line) for line in open(files[split][0])]


def test_the_cue_is_never_the_books_and_the_splits_read_disjoint_parts(tmp_path):
    words = book_words()
    assert len(words) > 20_000 and not any(c in w.lower() for c in CUES for w in words)
    files = write_evidence_documents(tmp_path, {"train": 40, "validation": 8, "test": 12}, seed=3)
    rows = {s: _rows(files, s) for s in files}
    assert {s: len(r) for s, r in rows.items()} == {"train": 40, "validation": 8, "test": 12}
    assert sorted(r["label"] for r in rows["train"]) == sorted(CUES * 10)  # balanced
    for split, docs in rows.items():
        lo, hi = SPLIT_SPANS[split]
        part = " ".join(words[int(lo * len(words)): int(hi * len(words))])
        for d in docs:
            text = d["text"].split()
            told = [i for i, w in enumerate(text) if w.rstrip(".") in CUES]
            assert told == [d["evidence_word"] + 6] and text[told[0]].rstrip(".") == d["label"]
            assert d["evidence_word"] < 0.4 * 200
            passage = text[:d["evidence_word"]] + text[d["evidence_word"] + 7:]
            assert " ".join(passage) in part  # consecutive words of its own part of the book
    assert write_evidence_documents(tmp_path / "again", {"train": 40}, seed=3)["train"] and \
        _rows({"train": [str(tmp_path / "again" / "train.jsonl")]}, "train") == rows["train"]
    with pytest.raises(ValueError, match="unknown split"):
        write_evidence_documents(tmp_path, {"dev": 1})


def test_the_last_segment_never_holds_the_evidence_as_the_run_cuts_it(tmp_path):
    """With the task's tokenizer (every word of the book one token, [CLS] and [SEP] around each segment) and
    the recipe's segments of 64 tokens, at most 6: nothing cut off, the cue in an earlier segment only."""
    files = write_evidence_documents(tmp_path, {"test": 60}, seed=1)
    path = write_book_tokenizer(tmp_path / "tokenizer")
    docs = load_labelled_documents(files=files, splits=("test",), tokenizer=path)["test"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert docs.cls_id == tokenizer.cls_token_id and docs.sep_id == tokenizer.sep_token_id
    for tokens, label in zip(docs.dataset["input_ids"], docs.dataset["label"]):
        assert tokenizer.unk_token_id not in tokens  # every word of the book is in the vocabulary
        segments = document_segments(tokens, 64, 6, docs.cls_id, docs.sep_id)
        assert 4 <= len(segments) <= 6 and sum(len(s) - 2 for s in segments) == len(tokens)  # nothing cut off
        cue = tokenizer.convert_tokens_to_ids(docs.label_names[label])
        assert cue not in segments[-1] and sum(int(cue in s) for s in segments[:-1]) == 1
