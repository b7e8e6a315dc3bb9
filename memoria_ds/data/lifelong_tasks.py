"""A sequence of small text-classification tasks made from the bundled book, for lifelong learning at CPU
scale (MbPA++, docs/episodic.md).

Each task has its own classes (no class is shared between tasks, as in the paper's five data sets
whose 33 classes are mostly disjoint) and its own cue vocabulary: a document is a passage of *Alice's
Adventures in Wonderland* (memoria_ds/assets/alice29.txt, public domain; `words` words from a random
start) with `cues` words of its class inserted at random places, as a topic's words are scattered through
a news article (each drawn from the class's `CUES_PER_CLASS` words, which the book never uses, made
here). A model that learns the tasks one after another, without replay, drifts to the last task's
classes and forgets the earlier ones; the memory's job is to keep them.

Scattered cues rather than one: with a single cue word (a needle among the passage's words) a tiny
encoder learned the first task and then none of the later ones (its loss stayed at ln 3 for the new
classes: the attention had stopped looking at new words); with four, every task is learned in its turn
(docs/episodic.md, "The CPU study").

    files = write_lifelong_tasks("data/lifelong", tasks=4, classes=3, counts={"train": 4000, "test": 60})
    # files["train"]: [task0/train.jsonl, task1/train.jsonl, ...] in task order; rows {"text", "label", "task"}
    # labels are "t<task>c<class>" (12 in all here); files["test"]: every task's test documents
    tokenizer = write_task_tokenizer("data/lifelong/tokenizer", tasks=4, classes=3)   # the book's words + the cues

Training passages come from the first 80% of the book's words, test passages from the rest, so no test
passage was read in training. Within a task the documents are in random order (the paper shuffles each
data set); the tasks follow each other in the order given (`order`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .evidence_documents import book_words, write_book_tokenizer

CUES_PER_CLASS = 2
_SYLLABLES = ("ka", "lo", "mi", "ru", "ze", "po", "ta", "ne", "vu", "si", "do", "fe")
SPLIT_SPANS = {"train": (0.0, 0.8), "test": (0.8, 1.0)}


def cue_words(tasks: int, classes: int) -> dict[tuple[int, int], list[str]]:
    """(task, class) -> its cue words: made-up words the book never uses, distinct everywhere."""
    book = {w.strip(".,;:!?\"'()").lower() for w in book_words()}
    rng = random.Random("cues")
    out: dict[tuple[int, int], list[str]] = {}
    used: set[str] = set()
    for key in [(t, c) for t in range(tasks) for c in range(classes)]:
        words = []
        while len(words) < CUES_PER_CLASS:
            w = "".join(rng.choice(_SYLLABLES) for _ in range(3))
            if w not in book and w not in used:
                used.add(w)
                words.append(w)
        out[key] = words
    return out


def label_name(task: int, cls: int) -> str:
    return f"t{task}c{cls}"


def write_lifelong_tasks(out_dir: str | Path, *, tasks: int = 4, classes: int = 3,
                         counts: dict[str, int] | None = None, words: int = 20, cues: int = 4,
                         order: list[int] | None = None, seed: int = 0) -> dict[str, list[str]]:
    """Write each task's splits to `<out_dir>/task<i>/<split>.jsonl`; returns `data.files` with the tasks of
    each split in `order` (the training order).

    Args:
        tasks / classes: how many tasks, and classes per task.
        counts: documents per task and split (`train`, `test`), classes balanced in turn.
        words: words of the book per document.
        cues: cue words of the document's class inserted into it, each at a random place.
        order: the task order (a permutation of range(tasks)); default 0, 1, ...
        seed: the passages, positions, cues and orders drawn.

    Raises:
        ValueError: an unknown split, an order that is not a permutation, sizes below 1.
    """
    counts = counts or {"train": 300, "test": 60}
    order = list(range(tasks)) if order is None else list(order)
    if sorted(order) != list(range(tasks)):
        raise ValueError(f"order {order} must be a permutation of the {tasks} tasks")
    if tasks < 1 or classes < 2 or words < 5 or cues < 1:
        raise ValueError(f"need at least 1 task, 2 classes, 5 words and 1 cue (got {tasks}, {classes}, {words}, {cues})")
    unknown = sorted(set(counts) - set(SPLIT_SPANS))
    if unknown:
        raise ValueError(f"unknown split(s) {unknown}; use {sorted(SPLIT_SPANS)}")
    book = book_words()
    vocabulary = cue_words(tasks, classes)
    out = Path(out_dir)
    files: dict[str, list[str]] = {}
    for split, n in counts.items():
        lo, hi = SPLIT_SPANS[split]
        part = book[int(lo * len(book)): int(hi * len(book))]
        for task in order:
            rng = random.Random(f"{seed}:{split}:{task}")
            labels = [i % classes for i in range(n)]
            rng.shuffle(labels)
            path = out / f"task{task}" / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as f:
                for cls in labels:
                    start = rng.randrange(len(part) - words)
                    passage = part[start: start + words]
                    for _ in range(cues):
                        passage.insert(rng.randrange(len(passage) + 1), rng.choice(vocabulary[(task, cls)]))
                    f.write(json.dumps({"text": " ".join(passage), "label": label_name(task, cls), "task": task})
                            + "\n")
            files.setdefault(split, []).append(str(path))
    return files


def write_task_tokenizer(out_dir: str | Path, *, tasks: int, classes: int) -> str:
    """The book's WordPiece tokenizer with every cue word of these tasks one token; returns its path."""
    return write_book_tokenizer(out_dir, [w for ws in cue_words(tasks, classes).values() for w in ws])


__all__ = ["CUES_PER_CLASS", "cue_words", "label_name", "write_lifelong_tasks", "write_task_tokenizer"]
