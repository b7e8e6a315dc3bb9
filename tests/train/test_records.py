"""Records that tell the truth (issue 17 item 7): no duplicate steps after a resume, every RNG seeded."""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from memoria_ds.train.metrics import drop_records_after
from memoria_ds.train.shards import seed_everything


def test_records_past_the_resumed_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"kind": "train", "step": s} for s in (1, 2, 3, 4)] + [{"kind": "eval", "step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "train", "st')  # torn by a kill
    assert drop_records_after(path, 3) == 2
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:3] + [lines[4]]
    assert drop_records_after(path, 3) == 0
    assert drop_records_after(tmp_path / "none.jsonl", 3) == 0


def test_seed_everything_seeds_python_numpy_and_torch():
    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    seed_everything(11)
    a = draw()
    seed_everything(11)
    assert draw() == a
    seed_everything(12)
    assert all(x != y for x, y in zip(draw(), a))
