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


def test_real_text_trains_memformer_through_spans(bench):
    """`--bptt 2`: one update per two segments, the memory's graph kept inside the span, so
    memformer's writer learns (with one segment per update it gets no gradient)."""
    a = argparse.Namespace(vocab_size=40, segment=8, layers=1, width=16, heads=2, num_wm=2, streams=2, steps=5,
                           lr=1e-2, weight_decay=0.0, grad_clip=1.0, reset="document_start", trace_blocks=0, bptt=2)
    corpus = bench.TokenCorpus.from_token_lists([torch.randint(0, 40, (120,)).tolist() for _ in range(2)])
    writer = {}
    for span in (1, 2):
        a.bptt = span
        model, losses, _ = bench.train("memformer+memory_settings={'num_slots':4}", 0, a, corpus)
        fresh, _ = bench.make_model("memformer+memory_settings={'num_slots':4}", a, seed=0)
        assert len(losses) == 5  # one loss per segment read, whatever the span
        moved = {n: not torch.equal(p, dict(fresh.named_parameters())[n]) for n, p in model.named_parameters()}
        writer[span] = any(v for n, v in moved.items() if "write" in n)
    assert writer == {1: False, 2: True}


def test_sorting_trains_memformer_through_whole_examples(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sorting.py"), "--segments", "2", "--segment", "16",
           "--variants", "memformer+memory_settings={'num_slots':4},xl", "--seeds", "0", "--train-examples", "16",
           "--test-examples", "8", "--batch", "4", "--epochs", "1", "--layers", "1", "--width", "16", "--heads", "2",
           "--threads", "1", "--bptt-example", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [r["updates"] for r in results] == [4, 4]  # one per batch of examples, not one per scored segment
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in results)
