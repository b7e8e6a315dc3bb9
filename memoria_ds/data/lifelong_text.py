"""The five text-classification data sets of MbPA++'s lifelong benchmark (de Masson d'Autume et al. 2019), read
from Zhang, Zhao and LeCun's (2015) CSV folders through `datasets`, sampled, and written as tasks in turn.

The benchmark: AG News (4 classes), Yelp (5), Amazon (5, the same five ratings as Yelp), DBPedia (14) and Yahoo
Answers (10): 33 classes in all; 115,000 training and 7,600 test examples drawn from each data set (the public
port Daikon-Sun/EM-in-LLL: `n_train`, `n_test`, `label_offsets`), read one data set after another in one of
four orders (its `run.sh`; the paper's orders).

    files = write_lifelong_text("data/mbpa", source="data/zhang_csv", order=ORDERS[1])
    # data/zhang_csv/ag_news_csv/{train,test}.csv, yelp_review_full_csv/..., as Zhang et al. distribute them
    # files: `data.files` {train: [one JSONL per data set, in the order], test: [...]}; rows {text, label, task}

The CSV folders are the ones the paper and both public ports read (Zhang et al.'s archive, linked from their
`Crepe` repository); `--source` names the folder that holds them. A row's text is its text fields joined by a
space (title and description for AG News, ...); its label the class's name in its space (`news: Sports`,
`question: Sports`; Yelp's and Amazon's are the same `review: 1 star` ... `review: 5 stars`); its task the data set's place in `DATASETS` (the same in every order).

    python -m memoria_ds.data.lifelong_text OUT --source ZHANG_CSV_DIR [--order 1] [--train 115000 --test 7600]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TextDataset:
    """One data set: its folder in Zhang et al.'s archive, its CSV's text columns, its class names, and the
    label space they belong to (Yelp's and Amazon's ratings are one space; AG News' and Yahoo's `Sports` two)."""

    name: str
    folder: str
    text_columns: tuple[str, ...]
    classes: tuple[str, ...]
    space: str

    def label(self, index: int) -> str:
        """The label of class `index` (0-based), e.g. `news: Sports`, `review: 5 stars`."""
        return f"{self.space}: {self.classes[index]}"


_STARS = ("1 star", "2 stars", "3 stars", "4 stars", "5 stars")
DATASETS: tuple[TextDataset, ...] = (
    TextDataset("ag_news", "ag_news_csv", ("title", "description"), ("World", "Sports", "Business", "Sci/Tech"),
                "news"),
    TextDataset("yelp", "yelp_review_full_csv", ("text",), _STARS, "review"),
    TextDataset("amazon", "amazon_review_full_csv", ("title", "content"), _STARS, "review"),
    TextDataset("dbpedia", "dbpedia_csv", ("title", "content"),
                ("Company", "EducationalInstitution", "Artist", "Athlete", "OfficeHolder", "MeanOfTransportation",
                 "Building", "NaturalPlace", "Village", "Animal", "Plant", "Album", "Film", "WrittenWork"), "wikipedia"),
    TextDataset("yahoo", "yahoo_answers_csv", ("question_title", "question_content", "best_answer"),
                ("Society & Culture", "Science & Mathematics", "Health", "Education & Reference",
                 "Computers & Internet", "Sports", "Business & Finance", "Entertainment & Music",
                 "Family & Relationships", "Politics & Government"), "question"),
)
BY_NAME = {d.name: d for d in DATASETS}
# The four orders (Daikon-Sun/EM-in-LLL `run.sh`, orders 0-3; the paper's i-iv)
ORDERS: dict[int, tuple[str, ...]] = {
    1: ("yelp", "ag_news", "dbpedia", "amazon", "yahoo"),
    2: ("dbpedia", "yahoo", "ag_news", "amazon", "yelp"),
    3: ("yelp", "yahoo", "amazon", "dbpedia", "ag_news"),
    4: ("ag_news", "yelp", "amazon", "yahoo", "dbpedia"),
}
TRAIN_PER_DATASET, TEST_PER_DATASET = 115_000, 7_600


def num_classes() -> int:
    """33: the classes of the five data sets, Yelp's and Amazon's shared."""
    return len({d.label(i) for d in DATASETS for i in range(len(d.classes))})


def read_dataset(source: str | Path, dataset: TextDataset, split: str):
    """One split of one data set from its CSV (no header: the class, 1-based, then the text columns), as a
    `datasets.Dataset` with `text` and `label` (the class name).

    Raises:
        FileNotFoundError: the CSV is not where Zhang et al.'s archive puts it, with where to get it.
    """
    import datasets

    path = Path(source) / dataset.folder / f"{split}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: unpack Zhang et al.'s {dataset.folder}.tar.gz (linked from "
                                f"github.com/zhangxiangxiao/Crepe) under {source}")
    rows = datasets.load_dataset("csv", data_files=str(path), split="train", column_names=["class",
                                 *dataset.text_columns], keep_default_na=False)

    def convert(row):
        text = " ".join(str(row[c]).replace("\\n", " ").strip() for c in dataset.text_columns if row[c])
        return {"text": text, "label": dataset.label(int(row["class"]) - 1)}

    return rows.map(convert, remove_columns=rows.column_names)


def write_lifelong_text(out_dir: str | Path, *, source: str | Path, order: tuple[str, ...] = ORDERS[1],
                        counts: dict[str, int] | None = None, seed: int = 0) -> dict[str, list[str]]:
    """Sample `counts` examples of each data set and split (default the paper's 115,000 / 7,600) and write
    `<out_dir>/<name>/<split>.jsonl`; returns `data.files` with the data sets in `order`.

    Raises:
        ValueError: an unknown data set, an order that repeats one, a split with fewer rows than asked.
        FileNotFoundError: a missing CSV.
    """
    counts = counts or {"train": TRAIN_PER_DATASET, "test": TEST_PER_DATASET}
    unknown = [n for n in order if n not in BY_NAME]
    if unknown or len(set(order)) != len(order):
        raise ValueError(f"order {list(order)}: give distinct data sets of {sorted(BY_NAME)}")
    out = Path(out_dir)
    files: dict[str, list[str]] = {}
    for split, n in counts.items():
        for name in order:
            dataset = BY_NAME[name]
            rows = read_dataset(source, dataset, split)
            if len(rows) < n:
                raise ValueError(f"{dataset.folder}/{split}.csv has {len(rows)} rows, fewer than the {n} asked")
            pick = np.random.default_rng([seed, DATASETS.index(dataset), split == "test"]).permutation(len(rows))[:n]
            path = out / name / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            task = DATASETS.index(dataset)
            with path.open("w", encoding="utf-8") as f:
                for row in rows.select(sorted(pick.tolist())).shuffle(seed=seed):
                    f.write(json.dumps({"text": row["text"], "label": row["label"], "task": task}) + "\n")
            files.setdefault(split, []).append(str(path))
    return files


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="MbPA++'s five data sets as lifelong tasks (JSONL per data set)")
    p.add_argument("out")
    p.add_argument("--source", required=True, help="the folder holding Zhang et al.'s *_csv folders")
    p.add_argument("--order", type=int, choices=sorted(ORDERS), default=1)
    p.add_argument("--train", type=int, default=TRAIN_PER_DATASET)
    p.add_argument("--test", type=int, default=TEST_PER_DATASET)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        files = write_lifelong_text(a.out, source=a.source, order=ORDERS[a.order],
                                    counts={"train": a.train, "test": a.test}, seed=a.seed)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(files))


if __name__ == "__main__":
    main()


__all__ = ["DATASETS", "ORDERS", "TEST_PER_DATASET", "TRAIN_PER_DATASET", "TextDataset", "num_classes",
           "read_dataset", "write_lifelong_text"]
