"""benchmarks/real_text.py and benchmarks/sorting.py run the Compressive Transformer and the
infinity-former presets: built at the benchmark's segment length, scored with and without
their memory, and trained end to end on the sorting task."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("real_text_benchmark", ROOT / "benchmarks" / "real_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["compressive", "infinity", "compressive+memory_settings={'compression':'max'}"])
def test_real_text_builds_and_scores_the_baselines(bench, variant):
    a = argparse.Namespace(vocab_size=40, segment=8, layers=1, width=16, heads=2, num_wm=2, eval_segments=3,
                           eval_windows=0, eval_batch=2)
    model, _ = bench.make_model(variant, a, seed=0)
    assert model.config.segment_length == 8 and model.config.memory_type == variant.split("+")[0]
    if "max" in variant:
        assert model.config.memory_settings["compression"] == "max"
    model.eval()
    docs = [torch.randint(0, 40, (60,)).tolist()]
    carried, reset = bench.score(model, docs, a), bench.score(model, docs, a, use_memory=False)
    assert carried[0] == pytest.approx(reset[0], rel=1e-6)  # the first segment has no memory to use
    assert carried[-1][0] != pytest.approx(reset[-1][0], rel=1e-9)  # the later ones read it


def test_sorting_trains_the_baselines(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sorting.py"), "--segments", "2", "--segment", "16",
           "--variants", "compressive,infinity", "--seeds", "0", "--train-examples", "16", "--test-examples", "8",
           "--batch", "4", "--epochs", "1", "--layers", "1", "--width", "16", "--heads", "2", "--threads", "1",
           "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["variant"], r["updates"]) for r in results] == [("compressive", 8), ("infinity", 8)]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["answer_nll"] > 0 for r in results)
