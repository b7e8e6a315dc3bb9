"""benchmarks/sorting.py: its counting ceilings are right, and it runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

from bench_util import ROOT, load_benchmark

from memoria_ds.data.sorting import generate_sorting, input_length_for


def slow_oracle(rows, segment: int, k: int) -> float:
    """Count the last k segments' input symbols by hand; name, at each answer position, the
    most frequent visible symbol not yet given (ties: the one seen first in the window; unseen
    symbols after all seen ones, ascending)."""
    correct = total = 0
    for row in rows:
        symbols, target = [int(s) for s in row["symbols"]], [int(t) for t in row["target"]]
        k_all = (len(symbols) + 20 + segment - 1) // segment
        window = symbols[max(0, (k_all - k) * segment):]
        counts = Counter(window)
        ranking = sorted(range(20), key=lambda s: (-counts[s], window.index(s) if s in counts else len(window) + s))
        for j in range(20):
            pick = [s for s in ranking if s not in target[:j]][0]
            correct += pick == target[j]
            total += 1
    return correct / total


def test_chance_is_the_permutation_guess():
    """A guesser that knows only that the answer is a permutation, simulated, scores CHANCE."""
    bench = load_benchmark("sorting.py", "sorting_benchmark")
    rng = np.random.default_rng(0)
    correct = trials = 0
    for _ in range(4000):
        target = rng.permutation(20)
        for j in range(20):
            left = target[j:]  # the symbols not yet given, in any order
            correct += rng.choice(left) == target[j]
            trials += 1
    assert abs(correct / trials - bench.CHANCE) < 0.006  # ~4 standard errors
    assert 0.179 < bench.CHANCE < 0.181


def test_oracle_matches_hand_counting_and_the_full_view_is_exact():
    bench = load_benchmark("sorting.py", "sorting_benchmark")
    segment, k_segments = 16, 4
    rows = generate_sorting(40, input_length_for(k_segments, segment), seed=3, split="test")
    seen = bench.oracle(rows, segment)
    assert len(seen) == k_segments
    for k in range(1, k_segments + 1):
        assert seen[k - 1] == pytest.approx(slow_oracle(rows, segment, k))
    assert seen[-1] == 1.0  # counting everything is the definition of the answer
    assert seen[0] < seen[-1]


@pytest.mark.slow
def test_the_benchmark_runs_and_its_table_reads_back(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sorting.py"), "--segments", "2", "--segment", "16",
           "--variants", "transformer,memoria_wm", "--seeds", "0", "--train-examples", "16", "--test-examples", "8",
           "--batch", "4", "--epochs", "1", "--layers", "1", "--width", "16", "--heads", "2", "--threads", "1", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    # 16 examples in batches of 4, the answer (SEP at 12) spans both 16-token segments: 8 updates
    assert [(r["variant"], r["segments"], r["updates"]) for r in results] == [("transformer", 2, 8), ("memoria_wm", 2, 8)]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["answer_nll"] > 0 for r in results)
    plain = results[0]  # a model without memory scores the same without it
    assert (plain["accuracy_memoryless"], plain["answer_nll_memoryless"]) == (plain["accuracy"], plain["answer_nll"])
    table = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sorting.py"), "--table", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert table.returncode == 0 and "memoria_wm" in table.stdout and "2 segments" in table.stdout
    assert "accuracy with the memory reset before every segment" in table.stdout and "memory +0.0 (n=1)" in table.stdout


@pytest.mark.parametrize("device, message", [("bogus", "--device bogus"), ("meta", "--device meta: cpu or cuda")]
                         + ([] if torch.cuda.is_available() else
                            [("cuda", "--device cuda: this machine has no CUDA device")]))  # fmt: skip
def test_a_device_it_cannot_use_is_refused_before_any_data(device, message):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sorting.py"), "--device", device], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and message in done.stderr.splitlines()[-1], done.stderr[-500:]
