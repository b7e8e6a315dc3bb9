"""SIGTERM (a cluster's preemption or time limit) ends a run after its step, with a checkpoint of
that step, through the real `deepspeed` launcher; resuming continues the same optimisation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from memoria_ds.train.checkpoints import find_latest, validate
from memoria_ds.train.preemption import EXIT_STOPPED

from .launch_util import FINETUNE, ROOT, TINY, check, free_port, losses_by_step, metrics, run_training

NO_DROPOUT = ("model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, "
              "embd_pdrop: 0.0, attn_pdrop: 0.0, memoria: {num_wm: 4, num_stm_reminded: 4, num_ltm_reminded: 4, "
              "stm_capacity: 16, search_depth: 2}}")


def test_sigterm_checkpoints_the_step_and_the_resumed_run_equals_the_uninterrupted_one(tmp_path):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    check(run_training(whole, NO_DROPOUT, "eval.at_end=false"))
    proc = run_training(stopped, NO_DROPOUT, "eval.at_end=false", fault="sigterm_after_step:4")
    assert proc.returncode == EXIT_STOPPED, proc.stderr[-3000:]
    assert "stopped by SIGTERM after step 4 of 6" in proc.stderr and "--resume auto" in proc.stderr, proc.stderr[-3000:]
    assert find_latest(stopped / "checkpoints")[0].step == 4  # not the periodic one of step 3
    assert not (stopped / "summary.json").exists()
    check(run_training(stopped, NO_DROPOUT, "eval.at_end=false", "checkpoint.resume=auto"))
    assert [r["step"] for r in metrics(stopped)] == [1, 2, 3, 4, 5, 6]
    a, b = losses_by_step(whole), losses_by_step(stopped)
    for step in (5, 6):  # trained after the resume from the stop's checkpoint
        assert a[step] == b[step], f"step {step}: uninterrupted {a[step]!r} vs resumed {b[step]!r}"


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_both_after_the_same_step(tmp_path):
    run = tmp_path / "run"
    proc = run_training(run, "checkpoint.every=0", "eval.at_end=false", ranks=2, fault="sigterm_after_step:2")
    assert proc.returncode == EXIT_STOPPED, proc.stderr[-3000:]
    assert proc.stderr.count("stopped by SIGTERM after step 2") == 1, proc.stderr[-3000:]
    info = validate(run / "checkpoints" / "step_00000002")
    assert info.world_size == 2 and sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        path = run / "metrics.jsonl"
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if any(r.get("kind") == "train" and r["step"] >= step for r in rows):
                return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no step {step} within {timeout} s")


@pytest.fixture
def memory_backed_dir(tmp_path):
    """A folder in RAM (tmpfs) where the machine has one, else `tmp_path`: this test times a stop
    against the launcher's 30 s, and on a CI machine a disk still writing back earlier tests'
    checkpoints can stall one rank's writes for that long (CI failed so twice: one rank waited in
    a collective until the launcher killed the other)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="memoria_ds-preemption-", dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_sigterm_to_the_whole_job_as_slurm_sends_it(memory_backed_dir):
    """SIGTERM to every process of the job (launcher and ranks), as `scancel` or preemption does."""
    run = memory_backed_dir / "run"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MEMORIA_DS_FAULT"):
        env.pop(key, None)
    cmd = [shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2",
           "--master_port", str(free_port()), FINETUNE, *TINY, f"run_dir={run}", "optim.max_steps=100000",
           "checkpoint.every=0", "eval.at_end=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _wait_for_step(run, 2, proc, timeout=300)
    # The launcher kills its ranks 30 s after its own SIGTERM: write back what earlier tests left
    # in the page cache first, so that this job's checkpoint does not wait for their data.
    os.sync()
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the job did not stop within 120 s of SIGTERM")
    took = time.monotonic() - start
    # both streams: the launcher reports on stdout which rank it killed and when
    # a stop past preemption.DUMP_AFTER_S prints every rank's stacks: keep them in the failure
    assert "stopped by SIGTERM after step" in err, f"{took:.1f} s after SIGTERM:\n{out[-2000:]}\n{err[-12000:]}"
    (ckpt,) = (run / "checkpoints").iterdir()
    info = validate(ckpt)
    assert info.world_size == 2 and info.step >= 2
    assert max(r["step"] for r in metrics(run)) == info.step, "the stop's step is logged and checkpointed"
