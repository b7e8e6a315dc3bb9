"""MbPA++'s five data sets from Zhang et al.'s CSV folders (`memoria_ds/data/lifelong_text.py`), on small CSVs
written here in that layout (no header, the 1-based class first, quoted fields, `\\n` escapes): the text fields
joined, 33 classes with Yelp's and Amazon's shared, tasks by data set, the sample seeded, refusals."""

from __future__ import annotations

import csv
import json

import pytest

from memoria_ds.data.lifelong_text import DATASETS, ORDERS, num_classes, write_lifelong_text


def write_csvs(root, rows_per_split=14):
    for d in DATASETS:
        for split in ("train", "test"):
            path = root / d.folder / f"{split}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", newline="", encoding="utf-8") as f:
                w = csv.writer(f, quoting=csv.QUOTE_ALL)
                for i in range(rows_per_split):
                    cls = i % len(d.classes) + 1
                    w.writerow([cls, *[f"{d.name} {split} {i} {c}, part\\nnext" for c in d.text_columns]])


def rows(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_the_five_data_sets_in_an_order_with_their_33_classes(tmp_path):
    write_csvs(tmp_path / "csv")
    files = write_lifelong_text(tmp_path / "out", source=tmp_path / "csv", order=ORDERS[2],
                                counts={"train": 14, "test": 4}, seed=3)
    assert [p.split("/")[-2] for p in files["train"]] == list(ORDERS[2])
    assert num_classes() == 33  # 4 + 5 (Yelp and Amazon share them) + 14 + 10
    labels = set()
    for path in files["train"] + files["test"]:
        name = path.split("/")[-2]
        dataset = next(d for d in DATASETS if d.name == name)
        docs = rows(path)
        assert len(docs) == (14 if path.endswith("train.jsonl") else 4)
        assert {d["task"] for d in docs} == {DATASETS.index(dataset)}
        for doc in docs:
            i = int(doc["text"].split()[2])  # the row it came from: its class and every text field, joined
            assert doc["label"] == dataset.label(i % len(dataset.classes))
            assert doc["text"].count(", part next") == len(dataset.text_columns)
        labels |= {d["label"] for d in docs}
    assert {"news: Sports", "question: Sports"} <= labels and len(labels) == 33  # every class of every set
    again = write_lifelong_text(tmp_path / "again", source=tmp_path / "csv", order=ORDERS[2],
                                counts={"train": 14, "test": 4}, seed=3)
    assert rows(again["train"][0]) == rows(files["train"][0])  # seeded
    yelp, amazon = (next(d for d in DATASETS if d.name == n) for n in ("yelp", "amazon"))
    assert yelp.label(4) == amazon.label(4) == "review: 5 stars"


def test_missing_files_too_few_rows_and_bad_orders_are_refused(tmp_path):
    write_csvs(tmp_path / "csv", rows_per_split=3)
    with pytest.raises(ValueError, match="fewer than the 5 asked"):
        write_lifelong_text(tmp_path / "out", source=tmp_path / "csv", counts={"train": 5})
    with pytest.raises(ValueError, match="distinct data sets"):
        write_lifelong_text(tmp_path / "out", source=tmp_path / "csv", order=("yelp", "yelp"))
    with pytest.raises(FileNotFoundError, match="Zhang et al.'s ag_news_csv.tar.gz"):
        write_lifelong_text(tmp_path / "out", source=tmp_path / "nowhere", order=("ag_news",))
