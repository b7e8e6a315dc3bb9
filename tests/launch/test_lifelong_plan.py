"""MbPA++'s lifelong table as runs (`launch/repro/lifelong.sh`, `memoria_ds/repro/lifelong.py`): the dry run
resolves the 12 runs at the paper's settings; the run mode refuses before any work when the data is missing."""

from __future__ import annotations

import subprocess
from pathlib import Path

from memoria_ds.data.lifelong_text import ORDERS
from memoria_ds.repro.lifelong import READINGS, resolve, runs

ROOT = Path(__file__).resolve().parents[2]


def test_every_order_and_method_resolves_at_the_papers_settings(tmp_path):
    selected = runs(tmp_path / "data", tmp_path / "runs", [1, 2, 3, 4], ["sequential", "replay", "multitask"])
    assert len(selected) == 12 and len({r.run_dir for r in selected}) == 12
    for run in selected:
        cfg = resolve(run)
        train = [Path(p).parent.name for p in cfg.data.files["train"]]
        assert train == list(ORDERS[run.order]) and cfg.optim.micro_batch_size == 32 and cfg.optim.lr == 3e-5
        assert (cfg.episodic.neighbours, cfg.episodic.adapt_steps, cfg.episodic.adapt_l2) == (32, 30, 1e-3)
        in_turn = run.method != "multitask"
        assert cfg.data.in_order == in_turn and cfg.episodic.enabled == in_turn
        assert cfg.episodic.replay_every == (10_000 if run.method == "replay" else 0) or not in_turn
        assert set(cfg.eval.protocols) == set(READINGS[run.method])


def test_the_launcher_dry_run_and_the_missing_data():
    dry = subprocess.run(["bash", str(ROOT / "launch/repro/lifelong.sh"), "--mode", "dry-run", "--data", "/nowhere"],
                         capture_output=True, text=True, cwd=ROOT)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("\norder ") == 12 and "33 classes" in dry.stdout and "57 replays of 100" in dry.stdout
    assert dry.stdout.count("17,968 steps of 32") == 12  # 5 x 115,000 documents in batches of 32
    run = subprocess.run(["bash", str(ROOT / "launch/repro/lifelong.sh"), "--data", "/nowhere"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "write the data first" in run.stderr
