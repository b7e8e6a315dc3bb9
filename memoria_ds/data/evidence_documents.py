"""Documents whose label is told once, far from their end: a long-document classification task made
from the bundled book, for measuring whether a memory carries evidence across segments.

Each document is a passage of *Alice's Adventures in Wonderland* (memoria_ds/assets/alice29.txt,
public domain; a random start, `words` words) with one sentence inserted that tells its class,
"The key of this passage is <cue>.", where <cue> is one of `CUES` (words the book never uses). The
sentence sits in the first `evidence_within` of the passage's words, so that a reader of the
document's last segment alone (a truncated encoder) cannot see it: it has to be carried from the
segment that holds it to the one where the document is classified. Everything else is the book's
own text, read as it is.

    files = write_evidence_documents("data/evidence", {"train": 2400, "validation": 100, "test": 200})
    # {"train": ["data/evidence/train.jsonl"], ...}: JSONL rows {"text", "label", "evidence_word"}
    tokenizer = write_book_tokenizer("data/evidence/tokenizer")   # `data.tokenizer` of a from-scratch BERT

The tokenizer is a BERT WordPiece tokenizer whose vocabulary is the book's words (lower-cased,
punctuation apart) and the cues: every word one token, `[CLS]` and `[SEP]` around each segment,
as a from-scratch BERT reads. (GPT-2's BPE, the default for from-scratch models, has no `[CLS]`:
the head then pools an arbitrary first token, and a tiny BERT did not learn this task with it.)

The splits draw their passages from disjoint thirds of the book (train from the first 60%,
validation and test from the next 20% each), so no held-out passage was read in training.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from pathlib import Path

from .corpora import bundled_chapters

CUES = ("amber", "cobalt", "emerald", "violet")  # none occurs in the book (tested)
SPLIT_SPANS = {"train": (0.0, 0.6), "validation": (0.6, 0.8), "test": (0.8, 1.0)}


def book_words() -> list[str]:
    """The bundled book's words (its chapters' text, whitespace-split, punctuation kept in the words)."""
    return [w for chapter in bundled_chapters() for w in chapter["text"].split()]


def make_document(words: list[str], rng: random.Random, length: int, label: int, evidence_within: float) -> dict:
    """One document: `length` consecutive words of `words` from a random start, the evidence sentence
    inserted before a random word in its first `evidence_within` of them."""
    start = rng.randrange(len(words) - length)
    passage = words[start: start + length]
    at = rng.randrange(max(1, int(length * evidence_within)))
    cue = CUES[label]
    passage[at:at] = ["The", "key", "of", "this", "passage", "is", f"{cue}."]
    return {"text": " ".join(passage), "label": cue, "evidence_word": at}


def write_evidence_documents(out_dir: str | Path, counts: dict[str, int], *, words: int = 200,
                             evidence_within: float = 0.4, seed: int = 0) -> dict[str, list[str]]:
    """Write each split's documents to `<out_dir>/<split>.jsonl`; returns `data.files` for them.

    Args:
        counts: documents per split (`train`, `validation`, `test`), labels balanced in turn.
        words: words of the book per document (the evidence sentence adds 7).
        evidence_within: the evidence lies in this leading fraction of the passage.
        seed: the passages, positions and label order drawn.

    Raises:
        ValueError: an unknown split, a passage longer than a split's part of the book, a fraction
            outside (0, 1).
    """
    if not 0 < evidence_within < 1:
        raise ValueError(f"evidence_within ({evidence_within}) must be in (0, 1)")
    book = book_words()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, n in counts.items():
        if split not in SPLIT_SPANS:
            raise ValueError(f"unknown split {split!r}; use any of {sorted(SPLIT_SPANS)}")
        lo, hi = SPLIT_SPANS[split]
        part = book[int(lo * len(book)): int(hi * len(book))]
        if words >= len(part):
            raise ValueError(f"documents of {words} words do not fit the {len(part)} words of the {split} part")
        rng = random.Random(f"{seed}:{split}")
        labels = [i % len(CUES) for i in range(n)]
        rng.shuffle(labels)
        path = out / f"{split}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for label in labels:
                f.write(json.dumps(make_document(part, rng, words, label, evidence_within)) + "\n")
        files[split] = [str(path)]
    return files


def write_book_tokenizer(out_dir: str | Path, extra_words: Iterable[str] = ()) -> str:
    """A BERT WordPiece tokenizer over the book's words, the cues and `extra_words` (another task's cues),
    saved to `out_dir`; returns its path."""
    from transformers import BertTokenizerFast

    pieces = {t for w in book_words() for t in re.findall(r"[a-z0-9]+|[^a-z0-9\s]", w.lower())}
    words = pieces | set(CUES) | {w.lower() for w in extra_words}
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    tokenizer.save_pretrained(str(out_dir))
    return str(out_dir)


__all__ = ["CUES", "book_words", "make_document", "write_book_tokenizer", "write_evidence_documents"]
