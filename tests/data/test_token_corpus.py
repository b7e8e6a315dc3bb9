"""TokenCorpus: flattening a tokenized dataset, the memory-mapped cache, truncation."""

from __future__ import annotations

import os

import datasets
import numpy as np
import pytest

from memoria_ds.data import TokenCorpus

DOCS = [[5, 6, 7], [], [300, 1], [9] * 5, [70000, 2]]


def test_from_token_lists_layout() -> None:
    c = TokenCorpus.from_token_lists(DOCS)
    assert c.tokens.dtype == np.int32  # 70000 does not fit uint16
    assert c.doc_offsets.tolist() == [0, 3, 3, 5, 10, 12]
    assert c.document(2).tolist() == [300, 1] and c.document(1).tolist() == []
    assert TokenCorpus.from_token_lists([[1, 255]]).tokens.dtype == np.uint8
    assert TokenCorpus.from_token_lists([[1, 256]]).tokens.dtype == np.uint16


def test_bad_offsets_are_refused() -> None:
    with pytest.raises(ValueError, match="start at 0"):
        TokenCorpus(np.arange(4), np.array([0, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        TokenCorpus(np.arange(4), np.array([0, 3, 2, 4]))


def test_from_dataset_respects_row_order_selection_and_shuffle(tmp_path) -> None:
    ds = datasets.Dataset.from_dict({"input_ids": DOCS})
    ds = ds.shuffle(seed=1).select([4, 0, 2, 1])  # an index mapping over the Arrow table
    expected = [list(ds[i]["input_ids"]) for i in range(len(ds))]
    c = TokenCorpus.from_dataset(ds, cache_dir=None)
    ref = TokenCorpus.from_token_lists(expected)
    np.testing.assert_array_equal(c.tokens, ref.tokens)
    np.testing.assert_array_equal(c.doc_offsets, ref.doc_offsets)


def test_from_dataset_writes_and_reuses_a_memory_mapped_cache(tmp_path) -> None:
    ds = datasets.Dataset.from_dict({"input_ids": DOCS})
    first = TokenCorpus.from_dataset(ds, cache_dir=tmp_path, metadata={"split": "x"})
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and all(f.endswith(".npy") for f in files), files
    assert isinstance(first.tokens, np.memmap)
    second = TokenCorpus.from_dataset(ds, cache_dir=tmp_path)
    assert sorted(os.listdir(tmp_path)) == files
    np.testing.assert_array_equal(first.tokens, second.tokens)
    assert first.fingerprint == second.fingerprint and first.metadata == {"split": "x"}
    other = TokenCorpus.from_dataset(datasets.Dataset.from_dict({"input_ids": DOCS[:2]}), cache_dir=tmp_path)
    assert other.fingerprint != first.fingerprint and other.num_tokens == 3


def test_missing_column_says_to_tokenize() -> None:
    with pytest.raises(ValueError, match="tokenize_documents"):
        TokenCorpus.from_dataset(datasets.Dataset.from_dict({"text": ["a"]}))


def test_truncate_documents_like_the_authors() -> None:
    c = TokenCorpus.from_token_lists([[1] * 7, [2] * 3, [3] * 6]).truncate_documents(3)
    assert c.doc_lengths.tolist() == [6, 3, 6]
    assert c.tokens.tolist() == [1] * 6 + [2] * 3 + [3] * 6
    assert c.metadata["documents_truncated_to_multiple_of"] == 3


def test_default_cache_sits_next_to_the_datasets_cache(tmp_path) -> None:
    from memoria_ds.data import CharVocabulary, local_documents, tokenize_documents

    (tmp_path / "a.txt").write_text("abcab")
    (tmp_path / "b.txt").write_text("ba")
    docs = local_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], cache_dir=str(tmp_path / "hf"))
    tokens = tokenize_documents(docs, CharVocabulary.from_data(b"abc"))["train"]
    c = TokenCorpus.from_dataset(tokens)
    cache_dir = os.path.dirname(tokens.cache_files[0]["filename"])
    assert isinstance(c.tokens, np.memmap) and os.path.dirname(c.tokens.filename) == cache_dir
    assert c.tokens.tolist() == [0, 1, 2, 0, 1, 1, 0] and c.doc_offsets.tolist() == [0, 5, 7]
