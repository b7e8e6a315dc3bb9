"""The CPU-scale lifelong tasks (`memoria_ds/data/lifelong_tasks.py`): disjoint classes and cues per task,
cues the book never uses and the tokenizer keeps whole, the order, the splits' disjoint parts of the book."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from memoria_ds.data.evidence_documents import book_words
from memoria_ds.data.labelled import load_labelled_documents
from memoria_ds.data.lifelong_tasks import cue_words, write_lifelong_tasks, write_task_tokenizer


def rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_tasks_have_their_own_classes_and_cues_in_the_given_order(tmp_path):
    files = write_lifelong_tasks(tmp_path, tasks=3, classes=2, counts={"train": 12, "test": 4}, order=[2, 0, 1])
    assert [p.split("/")[-2] for p in files["train"]] == ["task2", "task0", "task1"]
    cues = cue_words(3, 2)
    book = {w.strip(".,;:!?\"'()").lower() for w in book_words()}
    every = [w for ws in cues.values() for w in ws]
    assert len(set(every)) == len(every) == 12 and not set(every) & book
    for path in files["train"] + files["test"]:
        task = int(path.split("/")[-2][4:])
        docs = rows(path)
        assert {d["task"] for d in docs} == {task}
        assert Counter(d["label"] for d in docs) == {f"t{task}c0": len(docs) // 2, f"t{task}c1": len(docs) // 2}
        for d in docs:  # 4 cue words, all of the document's own class, among the book's 20 words
            found = [w for w in d["text"].split() if w in every]
            assert len(found) == 4 and set(found) <= set(cues[(task, int(d["label"][-1]))])
            assert len(d["text"].split()) == 24
    again = write_lifelong_tasks(tmp_path / "again", tasks=3, classes=2, counts={"train": 12, "test": 4},
                                 order=[2, 0, 1])
    assert rows(again["train"][0]) == rows(files["train"][0])  # seeded


def test_the_tokenizer_keeps_every_cue_whole_and_the_loader_reads_the_tasks(tmp_path):
    files = write_lifelong_tasks(tmp_path, tasks=2, classes=3, counts={"train": 6, "test": 3})
    tok = write_task_tokenizer(tmp_path / "tok", tasks=2, classes=3)
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    for w in (w for ws in cue_words(2, 3).values() for w in ws):
        assert t.tokenize(w) == [w]
    docs = load_labelled_documents(files=files, tokenizer=tok, splits=("train", "test"))
    assert docs["train"].num_documents == 12 and docs["train"].label_names == [
        "t0c0", "t0c1", "t0c2", "t1c0", "t1c1", "t1c2"]
    assert docs["train"].dataset["label"][:6] == [int(r["label"][-1]) for r in rows(files["train"][0])]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="permutation"):
        write_lifelong_tasks("/tmp/never", tasks=2, order=[0, 0])
    with pytest.raises(ValueError, match="unknown split"):
        write_lifelong_tasks("/tmp/never", tasks=2, counts={"validation": 3})
    with pytest.raises(ValueError, match="1 cue"):
        write_lifelong_tasks("/tmp/never", tasks=2, cues=0)
