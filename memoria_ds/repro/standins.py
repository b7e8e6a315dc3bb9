"""Stand-in data for smoke runs: small local files in the formats the real loaders read.

The real corpora come from the Hugging Face hub; a smoke run (CPU, CI, no network) reads
these instead, through the *same* loaders with `data.path` (docs/data.md):

    wikitext103  a directory with `wiki.train.raw`, `wiki.valid.raw`, `wiki.test.raw` in
                 WikiText's raw layout (` = Title = ` lines start articles)
    pg19         a `save_to_disk` DatasetDict of books (`text`, `short_book_title`, ...)
    enwik8       a directory holding a file `enwik8` of bytes, split by the enwik8 loader (smoke runs pass a small
                 `num_test_bytes`); only bytes of the 204-symbol vocabulary
    gpt2-tiny    a GPT-2 checkpoint directory (2 layers, 32 wide, random weights) standing
                 in for the pretrained `gpt2` / `gpt2-large` / `gpt2-xl` of Table 5
    hyperpartisan  a `save_to_disk` DatasetDict of labelled documents in Hyperpartisan's layout after
                 its preparation (`text`, `label` ClassLabel false/true; train / validation / test):
                 passages of the book, each told its class by one inserted sentence
                 (memoria_ds/data/evidence_documents.py)
    bert-tiny, roberta-tiny, longformer-tiny, bigbird-tiny
                 classifier checkpoints (2 layers, 32 wide, random weights, with a WordPiece tokenizer
                 of the book's words) standing in for Table 3's `bert-base-uncased`, `roberta-base`,
                 `allenai/longformer-base-4096`, `google/bigbird-roberta-base`

The text is the bundled public-domain book (memoria_ds/assets, chapters I-X for training,
XI for validation, XII for test). A number trained on stand-ins says nothing about the paper.

    python -m memoria_ds.repro.standins DIR [--only wikitext103,pg19,enwik8,gpt2-tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from ..data.corpora import BUNDLED_SPLITS, bundled_chapters

KINDS = ("wikitext103", "pg19", "enwik8", "gpt2-tiny", "hyperpartisan", "bert-tiny", "roberta-tiny", "longformer-tiny",
         "bigbird-tiny")
_WIKITEXT_NAMES = {"train": "wiki.train.raw", "validation": "wiki.valid.raw", "test": "wiki.test.raw"}


def _chapters(split: str) -> list[dict[str, str]]:
    chapters = bundled_chapters()
    return [chapters[i] for i in BUNDLED_SPLITS[split]]


def _wikitext(tmp: Path) -> None:
    """One article per chapter: ` = Title = `, blank lines as ` `, one paragraph per line."""
    for split, name in _WIKITEXT_NAMES.items():
        lines = []
        for ch in _chapters(split):
            lines += [" \n", f" = {ch['title']} = \n", " \n"]
            for para in ch["text"].split("\n\n")[2:]:  # after the heading and title lines
                text = " ".join(para.split())
                if text:
                    lines += [f" {text} \n", " \n"]
        (tmp / name).write_text("".join(lines))


def _pg19(tmp: Path) -> None:
    import datasets

    def books(split: str) -> datasets.Dataset:
        rows = _chapters(split)
        return datasets.Dataset.from_dict({
            "short_book_title": [r["title"] for r in rows], "publication_date": [1865] * len(rows),
            "url": ["memoria_ds/assets/alice29.txt"] * len(rows), "text": [r["text"] for r in rows]})

    datasets.DatasetDict({s: books(s) for s in BUNDLED_SPLITS}).save_to_disk(str(tmp))


def _enwik8(tmp: Path) -> None:
    """The book's bytes (ASCII, newlines kept: the loader drops them), as one `enwik8` file."""
    text = "".join(ch["text"] for s in ("train", "validation", "test") for ch in _chapters(s))
    (tmp / "enwik8").write_bytes(text.encode("ascii"))


def _gpt2_tiny(tmp: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=256)
    GPT2LMHeadModel(config).save_pretrained(str(tmp))


def _hyperpartisan(tmp: Path) -> None:
    import datasets

    from ..data.evidence_documents import CUES, write_evidence_documents

    files = write_evidence_documents(tmp / "jsonl", {"train": 16, "validation": 4, "test": 4}, words=60)
    label = datasets.ClassLabel(names=["false", "true"])

    def split(path: str) -> datasets.Dataset:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        return datasets.Dataset.from_dict({"text": [r["text"] for r in rows],
                                           "label": [CUES.index(r["label"]) % 2 for r in rows]},
                                          features=datasets.Features({"text": datasets.Value("string"), "label": label}))

    datasets.DatasetDict({s: split(paths[0]) for s, paths in files.items()}).save_to_disk(str(tmp))
    shutil.rmtree(tmp / "jsonl")


def _encoder(kind: str) -> Callable[[Path], None]:
    """A tiny random classifier of Table 3's `kind` with the book's WordPiece tokenizer, saved to a folder."""
    def write(tmp: Path) -> None:
        import torch
        from transformers import (AutoModelForSequenceClassification, AutoTokenizer, BertConfig, BigBirdConfig,
                                  LongformerConfig, RobertaConfig)

        from ..data.evidence_documents import write_book_tokenizer

        vocab = len(AutoTokenizer.from_pretrained(write_book_tokenizer(tmp)))
        shape = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, num_labels=2, pad_token_id=0)
        config = {"bert-tiny": lambda: BertConfig(max_position_embeddings=128, **shape),
                  "roberta-tiny": lambda: RobertaConfig(max_position_embeddings=130, type_vocab_size=1, **shape),
                  "longformer-tiny": lambda: LongformerConfig(max_position_embeddings=130, attention_window=[16, 16],
                                                              type_vocab_size=1, **shape),
                  "bigbird-tiny": lambda: BigBirdConfig(max_position_embeddings=128, block_size=4, num_random_blocks=1,
                                                        **shape)}[kind]()
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(str(tmp))
    return write


_WRITERS: dict[str, Callable[[Path], None]] = {"wikitext103": _wikitext, "pg19": _pg19, "enwik8": _enwik8,
                                               "gpt2-tiny": _gpt2_tiny, "hyperpartisan": _hyperpartisan,
                                               **{k: _encoder(k) for k in ("bert-tiny", "roberta-tiny",
                                                                          "longformer-tiny", "bigbird-tiny")}}


def stand_in_path(root: str | os.PathLike, kind: str) -> Path:
    """Where `write_standins` puts `kind` (the value for `data.path` / `model.backbone`)."""
    return Path(root) / kind


def write_standins(root: str | os.PathLike, kinds: Iterable[str] = KINDS) -> dict[str, Path]:
    """Write the stand-ins that are missing under `root`; returns kind -> path.

    Each is written into a temporary sibling and renamed into place, so several processes
    (one per node under srun) may call this at once and none ever reads a half-written one.

    Raises:
        ValueError: an unknown kind.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for kind in kinds:
        if kind not in _WRITERS:
            raise ValueError(f"unknown stand-in {kind!r}; choose from {KINDS}")
        final = stand_in_path(root, kind)
        if not final.exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
            try:
                target = tmp / "data"
                target.mkdir()
                _WRITERS[kind](target)
                try:
                    os.rename(target, final)
                except OSError:
                    if not final.exists():  # another process won the race otherwise
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        out[kind] = final
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root")
    p.add_argument("--only", default=",".join(KINDS), help="comma-separated kinds")
    a = p.parse_args(argv)
    try:
        paths = write_standins(a.root, [k for k in a.only.split(",") if k])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for kind, path in paths.items():
        print(f"stand-in {kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
