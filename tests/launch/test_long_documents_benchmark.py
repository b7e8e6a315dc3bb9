"""benchmarks/long_documents.py at a smoke size: the task written, the backbone and Memoria trained through the
real launcher, the segment-mean reading through `launch/evaluate.py`, the four readings printed and kept;
finished runs are read again, not rerun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bench_util import ROOT

# two launcher runs and an evaluation: the pieces have their own default-tier
# tests (the backbone and the segment mean: tests/train/test_classify_e2e.py; the task: tests/data)
pytestmark = pytest.mark.slow


def _run(out, *extra):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_documents.py"), "--seeds", "0", "--epochs",
                           "1", "--train-docs", "16", "--test-docs", "8", "--out", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu"))


def test_the_three_readings_through_the_launcher(tmp_path):
    out, record = tmp_path / "runs", tmp_path / "long.json"
    proc = _run(out, "--json", str(record))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(record.read_text())
    assert set(data["table"]) == {"truncated", "segment mean", "memoria", "memoria reset"}
    for name, row in data["table"].items():
        assert len(row["accuracy"]) == 1 and 0 <= row["accuracy"][0] <= 1, name
    (backbone,) = [r for r in data["runs"] if r["preset"] == "backbone"]
    assert "optim.bptt_segments=6" in backbone["command"] and "model.preset=backbone" in backbone["command"]
    assert set(backbone["readings"]) == {"full/last", "memoryless/last", "full/mean"}
    assert "segment mean" in proc.stdout and "memoria reset" in proc.stdout
    again = _run(out)  # every run finished: read, not trained again
    assert again.returncode == 0 and again.stdout.splitlines()[-4:] == proc.stdout.splitlines()[-4:]
    other = _run(out, "--epochs", "2")  # another recipe would reuse these runs as its own: refused
    assert other.returncode == 2 and "holds runs of other settings" in other.stderr
    bad = _run(out, "--seeds", "x")
    assert bad.returncode == 2 and "--seeds 'x'" in bad.stderr
