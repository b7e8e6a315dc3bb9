"""Corpora from local files, hub-layout directories and save_to_disk directories; bundled text; enwik8."""

from __future__ import annotations

import hashlib
import re
import zipfile
from importlib import resources
from pathlib import Path

import datasets
import numpy as np
import pytest

from memoria_ds.data import (
    ENWIK8_SYMBOLS,
    bundled,
    enwik8,
    enwik8_vocabulary,
    local_documents,
    pg19,
    prepare_corpus,
    split_wikitext_articles,
    wikitext103,
)

WIKI_LINES = {
    "train": [" = Alpha = \n", "", " Alpha text , one . \n", "", " = = Section = = \n", "", " More alpha . \n", "",
              " = Beta = \n", "", " Beta text . \n", ""],
    "validation": ["", " = Gamma = \n", "", " Gamma text . \n"],
    "test": [" = Delta = \n", " Delta . \n", " = Epsilon = \n", " Eps . \n"],
}
EXPECTED_ARTICLES = {
    "train": [("Alpha", "= Alpha = \n\n Alpha text , one . \n\n = = Section = = \n\n More alpha ."),
              ("Beta", "= Beta = \n\n Beta text .")],
    "validation": [("Gamma", "= Gamma = \n\n Gamma text .")],
    "test": [("Delta", "= Delta = \n Delta ."), ("Epsilon", "= Epsilon = \n Eps .")],
}


def articles(dsd: datasets.DatasetDict) -> dict[str, list[tuple[str, str]]]:
    return {k: list(zip(v["title"], v["text"])) for k, v in dsd.items()}


def test_split_wikitext_articles_by_top_level_heading() -> None:
    got = list(split_wikitext_articles(WIKI_LINES["train"]))
    assert [(a["title"], a["text"]) for a in got] == EXPECTED_ARTICLES["train"]


def write_hub_layout(root: Path, config: str, tables: dict[str, dict]) -> None:
    """A dataset repository as it sits on the hub (and after snapshot_download)."""
    lines = ["---", "configs:", f"- config_name: {config}", "  data_files:"]
    for split, columns in tables.items():
        (root / config).mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_dict(columns).to_parquet(str(root / config / f"{split}-00000-of-00001.parquet"))
        lines += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    (root / "README.md").write_text("\n".join(lines + ["---", "# local copy", ""]))


def test_wikitext103_from_raw_files_hub_layout_and_save_to_disk(tmp_path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for split, name in (("train", "wiki.train.raw"), ("validation", "wiki.valid.raw"), ("test", "wiki.test.raw")):
        (raw / name).write_text("\n".join(line.rstrip("\n") for line in WIKI_LINES[split]) + "\n")
    assert articles(wikitext103(raw, cache_dir=str(tmp_path / "c1"))) == EXPECTED_ARTICLES

    hub = tmp_path / "hub"
    write_hub_layout(hub, "wikitext-103-raw-v1", {k: {"text": v} for k, v in WIKI_LINES.items()})
    assert articles(wikitext103(hub, cache_dir=str(tmp_path / "c2"))) == EXPECTED_ARTICLES

    disk = tmp_path / "disk"
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in WIKI_LINES.items()}).save_to_disk(disk)
    assert articles(wikitext103(disk, cache_dir=str(tmp_path / "c3"))) == EXPECTED_ARTICLES


def books(n: int, prefix: str) -> dict[str, list]:
    return {"short_book_title": [f"{prefix}{i}" for i in range(n)], "publication_date": list(range(n)),
            "url": [""] * n, "text": [f"The text of {prefix}{i}." for i in range(n)]}


def test_pg19_first_n_training_books_from_a_hub_layout_directory(tmp_path) -> None:
    hub = tmp_path / "pg19"
    (hub / "data").mkdir(parents=True)
    for split, n in (("train", 5), ("validation", 2), ("test", 3)):
        datasets.Dataset.from_dict(books(n, split)).to_parquet(str(hub / "data" / f"{split}-00000-of-00001.parquet"))
    out = pg19(hub, num_train_books=3, cache_dir=str(tmp_path / "cache"))
    assert out["train"]["short_book_title"] == ["train0", "train1", "train2"]
    assert len(out["validation"]) == 2 and len(out["test"]) == 3

    disk = tmp_path / "disk"
    datasets.DatasetDict({s: datasets.Dataset.from_dict(books(n, s)) for s, n in
                          (("train", 5), ("validation", 2), ("test", 3))}).save_to_disk(disk)
    assert pg19(disk, num_train_books=2)["train"]["short_book_title"] == ["train0", "train1"]
    assert len(pg19(disk, num_train_books=None)["train"]) == 5


def test_local_documents_txt_jsonl_parquet(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("first doc\nline two\n")
    (tmp_path / "b.txt").write_text("second doc\n")
    txt = local_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], cache_dir=str(tmp_path / "c"))
    assert txt["train"]["text"] == ["first doc\nline two\n", "second doc\n"]  # one document per file

    (tmp_path / "d.jsonl").write_text('{"body": "x y", "id": 1}\n{"body": "z", "id": 2}\n')
    js = local_documents({"validation": str(tmp_path / "d.jsonl")}, text_field="body", cache_dir=str(tmp_path / "c"))
    assert js["validation"]["text"] == ["x y", "z"] and js["validation"]["id"] == [1, 2]

    datasets.Dataset.from_dict({"text": ["p", "q"]}).to_parquet(str(tmp_path / "e.parquet"))
    assert local_documents(str(tmp_path / "e.parquet"), cache_dir=str(tmp_path / "c"))["train"]["text"] == ["p", "q"]
    with pytest.raises(ValueError, match="no column 'missing'"):
        local_documents(str(tmp_path / "d.jsonl"), text_field="missing", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="file_format"):
        local_documents(str(tmp_path / "x.weird"))


def test_bundled_book_chapters_and_provenance() -> None:
    dsd = bundled()
    assert {k: len(v) for k, v in dsd.items()} == {"train": 10, "validation": 1, "test": 1}
    assert dsd["train"][0]["title"] == "CHAPTER I: Down the Rabbit-Hole"
    assert dsd["test"][0]["title"] == "CHAPTER XII: Alice's Evidence"
    assert dsd["test"][0]["text"].rstrip().endswith("THE END")
    assert all("\r" not in t and "\x1a" not in t for split in dsd.values() for t in split["text"])
    # SOURCE.md states the file's hash; keep the statement true.
    assets = resources.files("memoria_ds.assets")
    stated = re.search(r"sha256 of this file: `([0-9a-f]{64})`", assets.joinpath("SOURCE.md").read_text()).group(1)
    assert hashlib.sha256(assets.joinpath("alice29.txt").read_bytes()).hexdigest() == stated


def test_prepare_bundled_corpus() -> None:
    corpora = prepare_corpus("bundled")
    assert set(corpora) == {"train", "validation", "test"}
    train = corpora["train"]
    assert train.num_documents == 10 and train.metadata["split"] == "train"
    assert train.metadata["eos_between_documents"] and train.metadata["unit"] == "token"
    ends = train.doc_offsets[1:] - 1
    assert (np.asarray(train.tokens)[ends] == 50256).all(), "each chapter ends with <|endoftext|>"
    assert (np.asarray(train.tokens) == 50256).sum() == 10


ENWIK_LIKE = bytes([60, 112, 62, 10, 72, 195, 169, 9, 10, 32, 97, 10, 98, 99, 100, 101, 10, 102, 103, 104, 105, 106])


@pytest.mark.parametrize("as_zip", [False, True])
def test_enwik8_split_and_newlines(tmp_path, as_zip: bool) -> None:
    path = tmp_path / "enwik8"
    path.write_bytes(ENWIK_LIKE)
    if as_zip:
        with zipfile.ZipFile(tmp_path / "enwik8.zip", "w") as zf:
            zf.write(path, "enwik8")
        path = tmp_path / "enwik8.zip"
    kept = enwik8(path, newlines="keep", num_test_bytes=5)
    raw = {k: v[0]["text"].encode("latin-1") for k, v in kept.items()}
    assert raw == {"train": ENWIK_LIKE[:-10], "validation": ENWIK_LIKE[-10:-5], "test": ENWIK_LIKE[-5:]}
    dropped = enwik8(path, num_test_bytes=5)  # default: the paper's newline-free 204 symbols
    assert {k: v[0]["text"].encode("latin-1") for k, v in dropped.items()} == {
        k: v.replace(b"\n", b"") for k, v in raw.items()
    }
    vocab = enwik8_vocabulary()
    ids = vocab.encode(dropped["train"][0]["text"])
    assert vocab.decode(ids) == raw["train"].replace(b"\n", b"")
    with pytest.raises(ValueError, match="not in the"):
        vocab.encode("\n")
    assert len(enwik8_vocabulary("keep").encode("\n")) == 1


def test_enwik8_vocabulary_sizes_and_foreign_bytes(tmp_path) -> None:
    assert len(ENWIK8_SYMBOLS) == 204 and 10 not in ENWIK8_SYMBOLS
    assert enwik8_vocabulary().vocab_size == 204 and enwik8_vocabulary("keep").vocab_size == 205
    (tmp_path / "bad").write_bytes(bytes([0, 1, 2]) * 10)
    with pytest.raises(ValueError, match="not the standard enwik8"):
        enwik8(tmp_path / "bad", num_test_bytes=5)
    with pytest.raises(ValueError, match="newlines"):
        enwik8(tmp_path / "bad", newlines="strip")
