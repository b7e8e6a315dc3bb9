"""Hyperpartisan news detection (SemEval-2019 Task 4, `byarticle`), as the paper's Table 3 reads it.

645 news articles (HTML), each labelled hyperpartisan or not by crowd consensus, split as the
authors split them (cosmoquester/memoria, experiment/longseq_formers/data/hyperpartisan.py, which
copies Longformer's `scripts/hp-splits.json`): 516 training, 64 validation ("dev") and 65 test
articles, indices into the 645 in the lists' order. Each text is the article's HTML reduced to its
text (BeautifulSoup's `get_text()` with `html.parser`, here the standard library's parser: the
same text nodes, character references decoded, comments dropped) with every run of whitespace
made one space, as theirs.

**The lists overlap**: 51 of the 65 test articles are also training articles and 7 are validation
articles (train and validation are disjoint); `split_overlap()` counts them. Kept as the authors
have them, since their numbers were measured so.

    docs = load_hyperpartisan()                       # the hub's byarticle articles, split
    docs = load_hyperpartisan("data/hp")              # a copy written by the CLI below
    python -m memoria_ds.data.hyperpartisan data/hp [--source ARTICLES]    # write a split copy

In the classification loop: `data.path=hyperpartisan` (or the copy's folder).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import datasets

HUB_NAME = "SemEvalWorkshop/hyperpartisan_news_detection"  # the authors' `hyperpartisan_news_detection`, moved
PARQUET_REVISION = "refs/convert/parquet"  # the hub's conversion of the script dataset (scripts no longer run)
NUM_ARTICLES = 645
LABELS = ("false", "true")  # index = int(hyperpartisan)

HYPERPARTISAN_SPLITS: dict[str, list[int]] = {
    "train": [
        239, 342, 401, 424, 518, 374, 457, 81, 208, 216, 112, 77, 448, 596, 388, 505, 362, 180, 587, 398, 636, 297, 363,
        389, 148, 567, 163, 549, 472, 26, 427, 227, 213, 470, 346, 383, 585, 352, 22, 20, 390, 3, 97, 439, 637, 197,
        392, 480, 225, 414, 333, 561, 615, 359, 598, 107, 12, 195, 54, 459, 23, 455, 624, 233, 17, 499, 307, 416, 578,
        568, 220, 334, 65, 73, 170, 215, 447, 446, 606, 276, 502, 534, 582, 241, 425, 356, 192, 301, 514, 589, 466, 207,
        82, 201, 391, 366, 476, 594, 477, 126, 393, 508, 158, 483, 604, 206, 15, 353, 372, 512, 543, 330, 290, 539, 444,
        399, 410, 169, 125, 487, 74, 381, 479, 556, 292, 576, 224, 173, 441, 205, 29, 559, 509, 552, 317, 231, 296, 643,
        524, 209, 433, 397, 488, 18, 553, 149, 380, 168, 484, 234, 586, 486, 555, 232, 246, 373, 139, 458, 157, 644,
        257, 91, 53, 59, 341, 159, 36, 109, 2, 106, 485, 258, 422, 404, 313, 402, 183, 419, 283, 87, 351, 75, 187, 310,
        320, 19, 304, 38, 471, 129, 66, 151, 266, 268, 548, 328, 405, 371, 580, 51, 492, 474, 510, 468, 396, 308, 408,
        526, 622, 511, 63, 274, 531, 128, 368, 599, 426, 43, 360, 541, 454, 263, 407, 138, 76, 530, 517, 165, 641, 436,
        493, 326, 194, 202, 546, 238, 382, 92, 52, 120, 437, 71, 504, 532, 237, 314, 625, 617, 605, 171, 331, 456, 607,
        542, 55, 475, 584, 251, 611, 40, 122, 100, 570, 338, 137, 597, 101, 324, 95, 577, 31, 116, 176, 145, 211, 236,
        627, 143, 638, 620, 219, 10, 60, 198, 7, 293, 452, 590, 579, 141, 558, 160, 214, 166, 593, 538, 33, 364, 635,
        119, 250, 223, 319, 619, 339, 616, 618, 284, 533, 603, 302, 49, 588, 572, 575, 515, 21, 1, 103, 150, 529, 506,
        69, 343, 323, 482, 222, 535, 188, 14, 299, 489, 108, 140, 39, 420, 285, 86, 554, 259, 564, 400, 269, 281, 248,
        272, 24, 629, 130, 226, 525, 80, 117, 115, 305, 370, 465, 186, 93, 113, 46, 461, 378, 184, 336, 50, 309, 48, 72,
        495, 131, 507, 325, 298, 412, 406, 240, 278, 212, 279, 5, 90, 181, 8, 288, 61, 300, 174, 608, 58, 520, 449, 218,
        294, 354, 494, 417, 99, 154, 89, 527, 273, 11, 162, 610, 179, 56, 613, 329, 377, 335, 253, 501, 442, 252, 614,
        327, 98, 88, 631, 609, 547, 376, 581, 621, 152, 228, 4, 565, 540, 132, 110, 191, 30, 6, 189, 303, 270, 255, 415,
        172, 64, 267, 503, 78, 118, 235, 435, 167, 453, 282, 573, 291, 642, 123, 395, 551, 94, 450, 478, 311, 289, 153,
        102, 421, 277, 583, 164, 244, 229, 178, 217, 523, 96, 280, 68, 497, 430, 190, 516, 445, 428, 633, 536, 434, 387,
        355, 528, 287, 144, 210, 295, 385, 185, 467, 256, 44, 83, 67, 175, 204, 602, 42, 358, 384, 28, 45, 569, 127, 47,
        491, 265, 463, 121, 135, 460
    ],
    "validation": [
        182, 438, 545, 286, 142, 27, 394, 261, 411, 0, 79, 550, 640, 254, 560, 386, 62, 440, 104, 473, 155, 432, 124,
        133, 136, 519, 322, 318, 245, 249, 612, 349, 623, 591, 429, 306, 592, 375, 203, 544, 312, 114, 41, 344, 571,
        134, 462, 347, 464, 566, 350, 199, 562, 357, 361, 521, 574, 315, 243, 601, 260, 409, 337, 177
    ],
    "test": [
        537, 517, 23, 459, 593, 258, 227, 16, 204, 367, 159, 142, 214, 82, 182, 564, 411, 600, 610, 306, 21, 434, 625,
        197, 202, 489, 404, 400, 551, 320, 36, 435, 344, 183, 134, 19, 253, 231, 383, 572, 201, 528, 15, 116, 265, 221,
        462, 342, 465, 436, 490, 442, 547, 282, 535, 256, 160, 140, 555, 51, 540, 165, 504, 181, 147
    ],
}


class _Text(HTMLParser):
    """The text nodes of an HTML fragment, in order (character references decoded; comments,
    declarations and processing instructions left out, as BeautifulSoup's `get_text()`)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def clean_text(html: str) -> str:
    """An article's text as the authors' loader computes it: the HTML's text, whitespace runs made one space
    (no strip: a leading or trailing run stays one space)."""
    parser = _Text()
    parser.feed(html)
    parser.close()
    return re.sub(r"\s+", " ", "".join(parser.parts))


def hyperpartisan_splits(articles: datasets.Dataset) -> datasets.DatasetDict:
    """The 645 `byarticle` articles as `train` / `validation` / `test` (the authors' lists): columns `text`
    (cleaned), `label` (ClassLabel false / true) and `article` (the index into the 645).

    Raises:
        ValueError: not 645 articles, or no `text` / `hyperpartisan` column.
    """
    missing = [c for c in ("text", "hyperpartisan") if c not in articles.column_names]
    if missing:
        raise ValueError(f"Hyperpartisan articles need columns text and hyperpartisan; {missing[0]!r} is missing "
                         f"(they have {articles.column_names})")
    if len(articles) != NUM_ARTICLES:
        raise ValueError(f"Hyperpartisan's byarticle part has {NUM_ARTICLES} articles; this source has {len(articles)} "
                         f"(the split lists index the {NUM_ARTICLES})")
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(LABELS)),
                                  "article": datasets.Value("int64")})
    texts, flags = articles["text"], articles["hyperpartisan"]
    return datasets.DatasetDict({
        split: datasets.Dataset.from_dict({"text": [clean_text(texts[i]) for i in indices],
                                           "label": [int(flags[i]) for i in indices], "article": list(indices)},
                                          features=features)
        for split, indices in HYPERPARTISAN_SPLITS.items()})


def split_overlap() -> dict[str, int]:
    """Articles shared by two of the authors' splits."""
    s = {k: set(v) for k, v in HYPERPARTISAN_SPLITS.items()}
    return {"test&train": len(s["test"] & s["train"]), "test&validation": len(s["test"] & s["validation"]),
            "validation&train": len(s["validation"] & s["train"])}


def _hub_articles() -> datasets.Dataset:
    """The 645 articles from the hub's parquet conversion (two ways `datasets` addresses a converted config)."""
    errors = []
    for kwargs in ({"name": "byarticle"}, {"data_dir": "byarticle"}):
        try:
            return datasets.load_dataset(HUB_NAME, split="train", revision=PARQUET_REVISION, **kwargs)
        except Exception as e:  # noqa: BLE001 (offline, moved, renamed: every way is tried, then one line)
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    raise ValueError(f"Hyperpartisan could not be loaded from the hub ({HUB_NAME}, {PARQUET_REVISION}: "
                     f"{errors[-1]}); get the 645 byarticle articles (text, hyperpartisan) as parquet, jsonl or a "
                     f"save_to_disk folder, run `python -m memoria_ds.data.hyperpartisan DIR --source THEM`, and use "
                     f"data.path=DIR")


def _local_articles(source: Path) -> datasets.Dataset | datasets.DatasetDict:
    if source.is_dir():
        loaded = datasets.load_from_disk(str(source))
        return loaded
    kind = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}.get(source.suffix)
    if kind is None:
        raise ValueError(f"{source}: give a save_to_disk folder or a .parquet / .jsonl / .json / .csv file of the "
                         f"{NUM_ARTICLES} articles")
    return datasets.load_dataset(kind, data_files=str(source), split="train")


def load_hyperpartisan(source: str | os.PathLike | None = None) -> datasets.DatasetDict:
    """The split articles: from the hub (`source` None or "hyperpartisan"), a folder this module wrote (returned
    as it is), or the 645 raw articles in a local folder or file (split here).

    Raises:
        ValueError: nothing at `source`, a source that is not the 645 articles, or the hub out of reach (one
            line that says how to supply a copy).
    """
    if source is None or str(source) == "hyperpartisan":
        return hyperpartisan_splits(_hub_articles())
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"Hyperpartisan source {str(path)!r} does not exist")
    loaded = _local_articles(path)
    if isinstance(loaded, datasets.DatasetDict):
        if set(HYPERPARTISAN_SPLITS) <= set(loaded):
            return loaded
        if list(loaded) != ["train"]:
            raise ValueError(f"{path} holds splits {sorted(loaded)}: give the split copy this module writes or the "
                             f"{NUM_ARTICLES} raw articles")
        loaded = loaded["train"]
    return hyperpartisan_splits(loaded)


def write_hyperpartisan(out_dir: str | os.PathLike, source: str | os.PathLike | None = None) -> datasets.DatasetDict:
    """Write the split articles to `out_dir` (`save_to_disk`, written beside and renamed into place)."""
    splits = load_hyperpartisan(source)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        splits.save_to_disk(str(tmp / "data"))
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp / "data", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return splits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write Hyperpartisan (byarticle) in the authors' splits for data.path.")
    p.add_argument("out_dir")
    p.add_argument("--source", help="the 645 raw articles (parquet / jsonl / csv / save_to_disk); default: the hub")
    a = p.parse_args(argv)
    try:
        splits = write_hyperpartisan(a.out_dir, a.source)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sizes = ", ".join(f"{k} {len(v)}" for k, v in splits.items())
    print(f"wrote {a.out_dir}: {sizes}; overlap of the authors' lists: {split_overlap()}")
    return 0


__all__ = ["HYPERPARTISAN_SPLITS", "LABELS", "clean_text", "hyperpartisan_splits", "load_hyperpartisan", "split_overlap",
           "write_hyperpartisan"]


if __name__ == "__main__":
    sys.exit(main())
