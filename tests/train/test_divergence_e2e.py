"""A diverging run writes no checkpoint and its advice works (issue 17 item 3), through the launcher."""

from __future__ import annotations

import pytest
import json
import math

from .launch_util import check, metrics, run_training


def _errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error")]


@pytest.mark.slow
def test_a_diverging_run_keeps_only_good_checkpoints_and_resumes_from_them(tmp_path):
    run_dir = tmp_path / "run"
    check(run_training(run_dir, "optim.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=5"))
    start = json.loads((run_dir / "checkpoints" / "step_00000004" / "manifest.json").read_text())["meta"]
    assert 0 < start["weights_at_start"] < 10  # the initial weights' largest magnitude, kept for the run

    # lr 1000 from step 5: the first checkpoint after it (step 6) would hold a diverged model
    bad = run_training(run_dir, "optim.max_steps=12", "checkpoint.every=2", "checkpoint.keep_last=5",
                       "optim.lr=1000", "optim.nan_policy=stop")
    assert bad.returncode == 1, bad.stderr[-3000:]
    (line,) = _errors(bad)
    assert "the training state at step 6 is diverging: weights reach" in line, line
    assert "No checkpoint was written for step 6" in line and "step_00000004, with a lower optim.lr" in line, line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]

    # the advice works: resume from the named checkpoint with a sane learning rate
    check(run_training(run_dir, "optim.max_steps=12", "checkpoint.every=2", "checkpoint.keep_last=5", "optim.lr=1e-3"))
    losses = {r["step"]: r["loss"] for r in metrics(run_dir)}
    assert all(math.isfinite(losses[s]) and losses[s] < 12 for s in range(7, 13)), losses


def test_a_run_diverging_before_its_first_checkpoint_says_start_again(tmp_path):
    run_dir = tmp_path / "run"
    bad = run_training(run_dir, "optim.lr=1000", "checkpoint.every=1", launcher="python")
    assert bad.returncode == 1, bad.stderr[-3000:]
    (line,) = _errors(bad)
    assert "at step 1 is diverging" in line and "There is no earlier checkpoint: start again" in line, line
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
