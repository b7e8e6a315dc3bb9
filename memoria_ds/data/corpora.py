"""The paper's corpora and local files, as `datasets.DatasetDict`s of documents.

Every loader returns splits named `train` / `validation` / `test` (those that exist), one
row per document, the document's text in column `text`. With network they read the hub;
without, each takes `path=`: a local copy in hub layout (a cloned or `snapshot_download`ed
dataset repository), a `save_to_disk` directory, or the corpus's original files.

- `wikitext103`: WikiText-103 raw, split into articles at the ` = Title = ` headings.
- `pg19`: PG-19, the first `num_train_books` training books (default 2,000, as the
  paper and the infinity-former) plus all of validation and test.
- `enwik8` (enwik8.py): bytes, 90M / 5M / 5M.
- `local_documents`: any text / jsonl / json / parquet / csv files.
- `bundled`: the small public-domain book shipped in `memoria_ds/assets`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from importlib import resources
from typing import Any

import datasets

from memoria_ds.data.enwik8 import enwik8

WIKITEXT_HUB = "Salesforce/wikitext"
PG19_HUB = "emozilla/pg19"  # a parquet copy of deepmind/pg19 (whose loading script datasets>=4 cannot run)
_FORMATS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_WIKITEXT_FILES = {"train": "wiki.train.raw", "validation": "wiki.valid.raw", "test": "wiki.test.raw"}


def _offline_hint(name: str, err: Exception) -> OSError:
    return OSError(
        f"could not load {name!r} from the hub ({err}). Without network, copy the dataset from a machine "
        f"that has it (`hf download {name} --repo-type dataset --local-dir DIR`, or "
        "`load_dataset(...).save_to_disk(DIR)`) and pass data.path=DIR (in Python: path=DIR)"
    )


def load_dataset_dict(name_or_path: str, config: str | None = None, **kwargs: Any) -> datasets.DatasetDict:
    """`load_from_disk` for a `save_to_disk` directory, else `load_dataset` (hub id or local dir).

    Raises:
        OSError: the hub is unreachable, with the offline alternative in the message.
    """
    path = os.fspath(name_or_path)
    if os.path.isdir(path) and (
        os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(os.path.join(path, "state.json"))
    ):
        loaded = datasets.load_from_disk(path)
        return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})
    try:
        return datasets.load_dataset(path, config, **kwargs)
    except ConnectionError as err:
        raise _offline_hint(path, err) from err


# ---------------------------------------------------------------- WikiText-103

_ARTICLE_HEADING = re.compile(r"^ = [^=].* = $")


def split_wikitext_articles(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """Group WikiText lines into articles; a line ` = Title = ` starts a new one.

    Sub-headings (` = = Section = = `) stay inside their article. Lines are joined as
    they are (WikiText's lines keep their trailing newline) except blank lines, which
    become a bare newline: the hub copy stores them as "" and the original files as " ",
    so both sources give the same text, with the paragraph breaks of the original. The
    article is stripped of surrounding whitespace, as the authors did.
    """
    title, buf = None, []
    for line in lines:
        line = line if line.strip() else "\n"
        if _ARTICLE_HEADING.match(line.rstrip("\n")):
            if buf and "".join(buf).strip():
                yield {"title": title or "", "text": "".join(buf).strip()}
            title, buf = line.strip().strip("=").strip(), []
        buf.append(line)
    if buf and "".join(buf).strip():
        yield {"title": title or "", "text": "".join(buf).strip()}


def _articles_from(ds: datasets.Dataset, fingerprint: str, cache_dir: str | None) -> datasets.Dataset:
    def lines() -> Iterator[str]:
        for batch in ds.iter(batch_size=10_000):
            yield from batch["text"]

    def gen() -> Iterator[dict[str, str]]:
        yield from split_wikitext_articles(lines())

    return datasets.Dataset.from_generator(gen, fingerprint=fingerprint, cache_dir=cache_dir)


def wikitext103(
    path: str | os.PathLike | None = None,
    *,
    config: str = "wikitext-103-raw-v1",
    revision: str | None = None,
    cache_dir: str | None = None,
) -> datasets.DatasetDict:
    """WikiText-103 (raw), one row per article, columns `title` and `text`.

    Args:
        path: None for the hub (`Salesforce/wikitext`); a local hub-layout copy of that
            repository; a `save_to_disk` directory of the line dataset; or a directory
            with the original `wiki.train.raw`, `wiki.valid.raw`, `wiki.test.raw`.
        config: the hub config (`wikitext-2-raw-v1` for the small sibling).
        revision: hub revision to pin.
        cache_dir: `datasets` cache directory.
    """
    src = WIKITEXT_HUB if path is None else os.fspath(path)
    if os.path.isdir(src) and os.path.exists(os.path.join(src, _WIKITEXT_FILES["train"])):
        files = {k: os.path.join(src, v) for k, v in _WIKITEXT_FILES.items() if os.path.exists(os.path.join(src, v))}
        lines = datasets.load_dataset("text", data_files=files, keep_linebreaks=True, cache_dir=cache_dir)
    else:
        lines = load_dataset_dict(src, config, revision=revision, cache_dir=cache_dir)
    return datasets.DatasetDict(
        {split: _articles_from(ds, f"{ds._fingerprint}-articles-v1", cache_dir) for split, ds in lines.items()}
    )


# ---------------------------------------------------------------- PG-19


def _stream_rows(shards: list[tuple[str, str | None, str | None, str, int | None]]) -> Iterator[dict[str, Any]]:
    for name, config, revision, split, limit in shards:
        stream = datasets.load_dataset(name, config, revision=revision, split=split, streaming=True)
        if limit is not None:
            stream = stream.take(limit)
        yield from stream


def pg19(
    path: str | os.PathLike | None = None,
    *,
    num_train_books: int | None = 2000,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> datasets.DatasetDict:
    """PG-19: the first `num_train_books` training books, all validation and test books.

    The hub copy is read in streaming mode and only the books needed are downloaded and
    cached (the full training split is 11 GB); "first" is the order of the dataset.

    Args:
        path: None for the hub (`emozilla/pg19`), or a local copy (hub layout, or a
            `save_to_disk` directory).
        num_train_books: books kept from the start of `train`; None keeps all.
        revision: hub revision to pin.
        cache_dir: `datasets` cache directory.

    Returns:
        Columns as in the source (`text`, `short_book_title`, `publication_date`, `url`).
    """
    src = PG19_HUB if path is None else os.fspath(path)
    if os.path.isdir(src) and (
        os.path.exists(os.path.join(src, "dataset_dict.json")) or os.path.exists(os.path.join(src, "state.json"))
    ):
        out = load_dataset_dict(src)
        if num_train_books is not None:
            out["train"] = out["train"].select(range(min(num_train_books, len(out["train"]))))
        return out
    out = {}
    for split in ("train", "validation", "test"):
        limit = num_train_books if split == "train" else None
        key = (src, None, revision, split, limit)
        fingerprint = datasets.fingerprint.Hasher.hash(["pg19/1", key, _local_mtime(src)])
        try:
            out[split] = datasets.Dataset.from_generator(
                _stream_rows, gen_kwargs={"shards": [key]}, fingerprint=fingerprint, cache_dir=cache_dir
            )
        except (ConnectionError, datasets.exceptions.DatasetGenerationError) as err:
            if isinstance(err, ConnectionError) or isinstance(err.__cause__, ConnectionError):
                raise _offline_hint(src, err) from err
            raise
    return datasets.DatasetDict(out)


def _local_mtime(path: str) -> float | None:
    """Local sources change under the same name; their newest file time keys the cache."""
    if not os.path.isdir(path):
        return None
    return max((os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs), default=0.0)


# ---------------------------------------------------------------- local files


def local_documents(
    data_files: str | Sequence[str] | dict[str, str | Sequence[str]],
    *,
    text_field: str = "text",
    file_format: str | None = None,
    cache_dir: str | None = None,
) -> datasets.DatasetDict:
    """Documents from local files through `datasets`' packaged builders.

    Args:
        data_files: a file, a list of files (the split `train`) or `{split: files}`.
            Globs are allowed, as in `load_dataset`.
        text_field: the column that holds a document's text (renamed to `text`).
        file_format: `text`, `json`, `parquet` or `csv`; default from the extension.
            Plain text files are one document per file; json(l) / parquet / csv files
            are one document per row.
        cache_dir: `datasets` cache directory.

    Raises:
        ValueError: unknown format, or no `text_field` column.
    """
    files = data_files if isinstance(data_files, dict) else {"train": data_files}
    first = next(iter(files.values()))
    first = first if isinstance(first, str) else first[0]
    fmt = file_format or _FORMATS.get(os.path.splitext(first)[1].lower())
    if fmt not in ("text", "json", "parquet", "csv"):
        raise ValueError(f"cannot tell the format of {first!r}; pass file_format='text'|'json'|'parquet'|'csv'")
    kwargs: dict[str, Any] = {"sample_by": "document", "keep_linebreaks": True} if fmt == "text" else {}
    out = datasets.load_dataset(fmt, data_files=files, cache_dir=cache_dir, **kwargs)
    if fmt != "text" and text_field != "text":
        for split, ds in out.items():
            if text_field not in ds.column_names:
                raise ValueError(f"split {split!r} has no column {text_field!r} (columns: {ds.column_names})")
        out = out.rename_column(text_field, "text")
    for split, ds in out.items():
        if "text" not in ds.column_names:
            raise ValueError(f"split {split!r} has no column 'text' (columns: {ds.column_names}); pass text_field=...")
    return out


# ---------------------------------------------------------------- bundled text

_CHAPTER = re.compile(r"^\s*CHAPTER [IVXLC]+\s*$")
BUNDLED_SPLITS = {"train": range(0, 10), "validation": range(10, 11), "test": range(11, 12)}


def bundled_chapters() -> list[dict[str, str]]:
    """The chapters of the bundled book (`memoria_ds/assets/alice29.txt`, see SOURCE.md).

    Each is `CHAPTER N`, a blank line, the chapter title, a blank line, then the text with
    its line breaks (the centred headings are un-indented; the title page is dropped).
    """
    raw = resources.files("memoria_ds.assets").joinpath("alice29.txt").read_bytes().decode("ascii")
    lines = raw.replace("\r\n", "\n").replace("\x1a", "").split("\n")  # \x1a: a DOS end-of-file mark
    starts = [i for i, line in enumerate(lines) if _CHAPTER.match(line)]
    out = []
    for k, start in enumerate(starts):
        block = lines[start + 1 : starts[k + 1] if k + 1 < len(starts) else len(lines)]
        t = next(i for i, line in enumerate(block) if line.strip())  # the chapter title line
        heading, title = lines[start].strip(), block[t].strip()
        body = "\n".join(line.rstrip() for line in block[t + 1 :]).strip("\n")
        out.append({"title": f"{heading}: {title}", "text": f"{heading}\n\n{title}\n\n{body}\n"})
    return out


def bundled() -> datasets.DatasetDict:
    """The bundled public-domain book, one document per chapter: train I-X, validation XI, test XII."""
    chapters = bundled_chapters()
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_list([chapters[i] for i in idx]) for split, idx in BUNDLED_SPLITS.items()}
    )


CORPORA = {"wikitext103": wikitext103, "pg19": pg19, "enwik8": enwik8, "bundled": bundled}


def load_corpus(name: str, **kwargs: Any) -> datasets.DatasetDict:
    """A corpus by name: `wikitext103`, `pg19`, `enwik8`, `bundled` (kwargs to its loader)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose from {sorted(CORPORA)} or use local_documents(...)")
    return CORPORA[name](**kwargs)
