"""Hyperpartisan news detection (SemEval-2019 Task 4, `byarticle`), as the paper's Table 3 reads it.

645 news articles (HTML), each labelled hyperpartisan or not, split as the authors split them
(cosmoquester/memoria, experiment/longseq_formers/data/hyperpartisan.py, which copies Longformer's
`scripts/hp-splits.json`): 516 training, 64 validation ("dev") and 65 test articles, indices into the
645 in the lists' order. Each text is what the authors' `BeautifulSoup(html, "html.parser").get_text()`
gives (computed here with the standard library's parser, see `clean_text`), every run of whitespace
then made one space (`re.sub(r"\\s+", " ", ...)`, nothing stripped); the label is `int(hyperpartisan)`.

**The lists overlap**: 51 of the 65 test articles are also training articles and 7 are validation
articles (train and validation are disjoint; 7 test articles are in neither). `split_overlap()` counts
them. Kept as the authors have them, since their numbers were measured so.

    docs = load_hyperpartisan()                       # the hub's byarticle articles, split
    docs = load_hyperpartisan("data/hp")              # a copy written by the CLI below
    python -m memoria_ds.data.hyperpartisan data/hp [--source ARTICLES]    # write a split copy

In the classification loop: `data.path=hyperpartisan` (or the copy's folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from html.entities import html5
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

# ------------------------------------------------------------------------------ the article's text

# BeautifulSoup 4.12 (current when the authors' requirements named an unpinned `bs4`), html.parser builder:
_STRING_CONTAINERS = frozenset({"script", "style", "template", "rt", "rp"})  # their strings are not get_text()'s
_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "keygen", "link", "menuitem", "meta",
                   "param", "source", "track", "wbr", "basefont", "bgsound", "command", "frame", "image", "isindex",
                   "nextid", "spacer"})  # closed as soon as opened


def _entity_texts() -> dict[str, str]:
    """Entity name (without ";") -> its text, the first of each name in sorted order, as bs4's table."""
    table: dict[str, str] = {}
    for name, text in sorted(html5.items()):
        table.setdefault(name.removesuffix(";"), text)
    return table


_ENTITIES = _entity_texts()


class _Text(HTMLParser):
    """The strings BeautifulSoup's `get_text()` joins, from the parser events its html.parser builder sees.

    As bs4: character references decoded by its rules (numbers below 256 as windows-1252, an unknown
    `&name;` kept as `&name` without its `;`); comments, declarations and processing instructions left
    out; CDATA sections kept; strings inside an open <script>, <style>, <template>, <rt> or <rp> (in bs4's
    tag stack: an end tag closes every tag opened after its start tag, a stray one closes nothing) left out.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)  # bs4 decodes references itself, not as html.unescape does
        self.parts: list[str] = []
        self._open: list[str] = []  # bs4's stack of open tags
        self._hidden = 0  # string containers among them
        self._closed_void: list[str] = []  # void tags closed at once, whose next end tag bs4 then ignores

    def _push(self, tag: str) -> None:
        self._open.append(tag)
        self._hidden += tag in _STRING_CONTAINERS

    def _pop_to(self, tag: str) -> None:
        if tag not in self._open:
            return
        while True:
            top = self._open.pop()
            self._hidden -= top in _STRING_CONTAINERS
            if top == tag:
                return

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._push(tag)
        if tag in _VOID:
            self._pop_to(tag)
            self._closed_void.append(tag)

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        self._push(tag)
        self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self._closed_void:
            self._closed_void.remove(tag)
        else:
            self._pop_to(tag)

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.parts.append(data)

    def handle_charref(self, name: str) -> None:
        code = int(name[1:], 16) if name[:1] in "xX" else int(name)
        text = None
        if code < 256:
            try:
                text = bytes([code]).decode("windows-1252")
            except UnicodeDecodeError:
                pass
        if not text:
            try:
                text = chr(code)
            except (ValueError, OverflowError):
                pass
        self.handle_data(text or "\N{REPLACEMENT CHARACTER}")

    def handle_entityref(self, name: str) -> None:
        self.handle_data(_ENTITIES.get(name, "&" + name))

    def unknown_decl(self, data: str) -> None:
        if data.upper().startswith("CDATA["):
            self.parts.append(data[len("CDATA["):])  # bs4's CData: text even inside a string container


def clean_text(html: str) -> str:
    """An article's text as the authors' loader computes it: `BeautifulSoup(html, "html.parser").get_text()`,
    then every run of whitespace made one space (no strip: a leading or trailing run stays one space).

    Equal to bs4 4.12 on the same Python (compared with it on tricky markup in tests/data/test_hyperpartisan.py,
    where bs4 is installed); bs4 also makes a string of ASCII whitespace between tags one space or newline,
    which the collapse makes equal. Where it may differ: another bs4 (before 4.9 the text of <script> and
    <style> was text), another Python (`html.parser` has changed how it reads comments, CDATA and <script>
    ends in recent releases; bs4 and this function share the running Python's parser), and markup that
    `html.parser` rejects (bs4 raises ParserRejectedMarkup).

    Args:
        html: an article's HTML.

    Returns:
        its text, whitespace runs made one space.
    """
    parser = _Text()
    parser.feed(html)
    parser.close()
    return re.sub(r"\s+", " ", "".join(parser.parts))


# ------------------------------------------------------------------------------ the authors' splits

def hyperpartisan_splits(articles: datasets.Dataset) -> datasets.DatasetDict:
    """The 645 `byarticle` articles as the authors split them.

    Args:
        articles: the 645 articles in the hub's order, columns `text` (HTML) and `hyperpartisan` (bool);
            other columns are ignored.

    Returns:
        `train` / `validation` / `test`, in the lists' order: `text` (cleaned), `label` (ClassLabel
        false / true, index = int(hyperpartisan)) and `article` (the index into the 645).

    Raises:
        ValueError: not 645 articles, or no `text` / `hyperpartisan` column.
    """
    missing = [c for c in ("text", "hyperpartisan") if c not in articles.column_names]
    if missing:
        raise ValueError(f"Hyperpartisan articles need columns text and hyperpartisan; {missing[0]!r} is missing "
                         f"(they have {articles.column_names})")
    if len(articles) != NUM_ARTICLES:
        raise ValueError(f"Hyperpartisan's byarticle part has {NUM_ARTICLES} articles; this source has {len(articles)} "
                         f"(the split lists index the {NUM_ARTICLES} in the hub's order)")
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(LABELS)),
                                  "article": datasets.Value("int64")})
    texts, flags = articles["text"], articles["hyperpartisan"]
    return datasets.DatasetDict({
        split: datasets.Dataset.from_dict({"text": [clean_text(texts[i]) for i in indices],
                                           "label": [int(flags[i]) for i in indices], "article": list(indices)},
                                          features=features)
        for split, indices in HYPERPARTISAN_SPLITS.items()})


def split_overlap() -> dict[str, int]:
    """Articles shared by two of the authors' splits: {"test&train": 51, "test&validation": 7,
    "validation&train": 0}."""
    s = {k: set(v) for k, v in HYPERPARTISAN_SPLITS.items()}
    return {"test&train": len(s["test"] & s["train"]), "test&validation": len(s["test"] & s["validation"]),
            "validation&train": len(s["validation"] & s["train"])}


# ------------------------------------------------------------------------------ sources

# `datasets` >= 4 runs no loading script, so the authors' script dataset is read from the hub's parquet
# conversion. That branch has no README of configs: its one config is "default" and each of the script's
# configs is a folder (`byarticle/train/*.parquet`), so it is addressed by `data_dir` (a `name` is refused:
# "BuilderConfig 'byarticle' not found. Available: ['default']"). The second way serves a repository whose
# main branch has been converted to parquet with configs.
_HUB_WAYS = ({"data_dir": "byarticle", "revision": PARQUET_REVISION}, {"name": "byarticle"})


def _hub_articles() -> datasets.Dataset:
    """The 645 articles from the hub, or one line that says how to supply a copy."""
    errors = []
    for way in _HUB_WAYS:
        try:
            return datasets.load_dataset(HUB_NAME, split="train", **way)
        except Exception as e:  # noqa: BLE001 (offline, moved, renamed: every way is tried, then one line)
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            if isinstance(e, ConnectionError):  # the hub is out of reach: the other way would wait for it again
                break
    raise ValueError(f"Hyperpartisan could not be loaded from the hub ({HUB_NAME}; {errors[0]}); get the 645 byarticle "
                     f"articles (columns text, hyperpartisan, in the hub's order) as parquet, jsonl or a save_to_disk "
                     f"folder, run `python -m memoria_ds.data.hyperpartisan DIR --source THEM`, and use data.path=DIR")


def _local(source: Path) -> datasets.Dataset | datasets.DatasetDict:
    """What is at `source`: a `save_to_disk` folder, or a parquet / json(l) / csv file."""
    if source.is_dir():
        try:
            return datasets.load_from_disk(str(source))
        except FileNotFoundError as e:
            raise ValueError(f"{source} is not a save_to_disk folder ({str(e).splitlines()[0]}); give a folder "
                             f"this module wrote, or the {NUM_ARTICLES} articles saved by save_to_disk or as a file"
                             ) from None
    kind = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}.get(source.suffix)
    if kind is None:
        raise ValueError(f"{source}: give a save_to_disk folder or a .parquet / .jsonl / .json / .csv file of the "
                         f"{NUM_ARTICLES} articles")
    try:
        return datasets.load_dataset(kind, data_files=str(source), split="train")
    except (ValueError, OSError, datasets.exceptions.DatasetsError) as e:
        cause = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        raise ValueError(f"{source} could not be read as {kind} ({cause}); give the {NUM_ARTICLES} articles as "
                         f"parquet, jsonl or csv (columns text, hyperpartisan)") from None


def load_hyperpartisan(source: str | os.PathLike | None = None) -> datasets.DatasetDict:
    """Hyperpartisan in the authors' splits.

    Args:
        source: None or "hyperpartisan": the hub. A folder this module wrote (a `save_to_disk` DatasetDict with
            train / validation / test, each with text and label): returned as it is. The 645 raw articles (a
            `save_to_disk` Dataset, or a DatasetDict of one `train` split, or a parquet / json(l) / csv file):
            split by `hyperpartisan_splits`.

    Returns:
        `train` / `validation` / `test` with `text`, `label` (ClassLabel false / true) and `article`.

    Raises:
        ValueError: nothing at `source`, a source that is neither, or the hub out of reach (one line that says
            how to supply a copy).
    """
    if source is None or str(source) == "hyperpartisan":
        return hyperpartisan_splits(_hub_articles())
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"Hyperpartisan source {str(path)!r} does not exist")
    loaded = _local(path)
    if isinstance(loaded, datasets.DatasetDict):
        if set(HYPERPARTISAN_SPLITS) <= set(loaded):
            lacking = [(s, c) for s in HYPERPARTISAN_SPLITS for c in ("text", "label")
                       if c not in loaded[s].column_names]
            if lacking:
                raise ValueError(f"{path}: split {lacking[0][0]!r} has no column {lacking[0][1]!r}; give the split "
                                 f"copy this module writes or the {NUM_ARTICLES} raw articles")
            return loaded
        if list(loaded) != ["train"]:
            raise ValueError(f"{path} holds splits {sorted(loaded)}: give the split copy this module writes or the "
                             f"{NUM_ARTICLES} raw articles")
        loaded = loaded["train"]
    return hyperpartisan_splits(loaded)


# ------------------------------------------------------------------------------ a local copy

def _is_copy(folder: Path) -> bool:
    """Whether `folder` holds a `save_to_disk` DatasetDict of exactly the authors' three splits."""
    try:
        return json.loads((folder / "dataset_dict.json").read_text())["splits"] == list(HYPERPARTISAN_SPLITS)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_hyperpartisan(out_dir: str | os.PathLike, source: str | os.PathLike | None = None) -> datasets.DatasetDict:
    """Write the split articles to `out_dir` with `save_to_disk`, into a temporary sibling renamed into place
    (a copy already there is replaced; nothing else is).

    Raises:
        ValueError: `out_dir` holds something else, or `source` as `load_hyperpartisan`.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and not _is_copy(out) and (out.is_file() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not a Hyperpartisan copy this module wrote; give a new folder")
    splits = load_hyperpartisan(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        splits.save_to_disk(str(tmp / "new"))
        if out.exists():
            os.rename(out, tmp / "old")  # set aside, not deleted, until the new copy is in place
        os.rename(tmp / "new", out)
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
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sizes = ", ".join(f"{k} {len(v)}" for k, v in splits.items())
    print(f"wrote {a.out_dir}: {sizes}; the authors' lists overlap: {split_overlap()}")
    return 0


__all__ = ["HYPERPARTISAN_SPLITS", "LABELS", "NUM_ARTICLES", "clean_text", "hyperpartisan_splits", "load_hyperpartisan",
           "split_overlap", "write_hyperpartisan"]


if __name__ == "__main__":
    sys.exit(main())
