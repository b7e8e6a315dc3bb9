"""One run per run directory (issue 17 item 4): a second run is refused, a killed one leaves no lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from memoria_ds.train.run_lock import LOCK_NAME, RunDirInUse, RunDirUnusable, RunLock, probe

from .launch_util import FINETUNE, ROOT, TINY, check, run_training

HOLD = "import sys, time; from memoria_ds.train.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); " \
       "print('held', flush=True); time.sleep(600)"


def _holder(run_dir):
    """Another process that holds the lock of `run_dir` until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_probe_and_lock_in_one_directory(tmp_path):
    probe(tmp_path / "new")  # nothing there: free, and nothing is created
    assert not (tmp_path / "new").exists()
    with RunLock(tmp_path / "run") as lock:
        info = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid()
        assert lock.path.exists()
    probe(tmp_path / "run")  # released: free again
    RunLock(tmp_path / "run").acquire()  # and can be taken again


def test_a_run_dir_that_cannot_be_a_directory_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirUnusable, match=r"run_dir .*/file is a file; choose a directory path"):
        probe(tmp_path / "file")
    with pytest.raises(RunDirUnusable, match=r"run_dir .*/file/a/b lies under .*/file, which is a file"):
        probe(tmp_path / "file" / "a" / "b")
    probe(tmp_path / "a" / "b")  # missing parents are fine: the run creates them
    proc = run_training(tmp_path / "file" / "run", launcher="python")  # through the real launcher: exit 2, one line
    assert proc.returncode == 2 and "lies under" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_run_dir_where_nothing_can_be_created_is_named_and_the_probe_leaves_nothing(tmp_path):
    """/proc accepts `access(W_OK)` from root and still refuses mkdir: the probe tries instead of asking."""
    with pytest.raises(RunDirUnusable, match=r"run_dir /proc/memoria_run: nothing can be created in /proc "):
        probe("/proc/memoria_run")
    probe(tmp_path)  # an existing, writable directory: the probe's trial directory is gone again
    assert list(tmp_path.iterdir()) == []
    proc = run_training("/proc/memoria_run", launcher="python")
    assert proc.returncode == 2 and "nothing can be created in /proc" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_live_holder_is_named_and_a_killed_one_leaves_no_lock(tmp_path):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        with pytest.raises(RunDirInUse, match=rf"in use by another run \(pid {holder.pid} on .*choose another run_dir"):
            probe(run_dir)
        with pytest.raises(RunDirInUse, match=str(holder.pid)):
            RunLock(run_dir).acquire(wait_s=0.2)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    probe(run_dir)  # the kernel released it with the process: no stale lock
    RunLock(run_dir).acquire(wait_s=0.2)


def test_a_run_on_a_directory_in_use_stops_at_once_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        proc = run_training(run_dir)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and f"pid {holder.pid}" in lines[0] and "choose another run_dir" in lines[0], lines
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # no config.yaml, metrics or checkpoints
    check(run_training(run_dir))  # the holder is gone: the directory is free


def test_two_real_runs_on_one_directory(tmp_path):
    """The second of two launcher runs on one directory is refused while the first goes on
    writing its records alone; once the first is killed the directory is free again."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    for key in ("MEMORIA_DS_FAULT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # an in-process test before may have left a process group's address here
    # Far more steps than the test waits for: the first run is surely still running when the
    # second starts (a short first run can finish first on a fast machine; then nothing is refused).
    first = subprocess.Popen(
        [sys.executable, FINETUNE, *TINY, f"run_dir={run_dir}", "optim.max_steps=1000000", "checkpoint.every=50",
         "eval.at_end=false", "engine=torch"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )

    def steps():
        text = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
        complete = text[: text.rfind("\n") + 1].splitlines()  # a record being written is not read
        return [r["step"] for r in map(json.loads, complete) if r["kind"] == "train"]

    def wait_for(condition):
        deadline = time.monotonic() + 300
        while not condition():
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)

    try:
        wait_for(lambda: steps())
        second = run_training(run_dir, "optim.max_steps=150", "engine=torch", launcher="python")
        refused_at = steps()[-1]
        wait_for(lambda: steps()[-1] >= refused_at + 20)  # the first goes on after the refusal
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert second.returncode == 2 and "is in use by another run" in second.stderr, second.stderr[-3000:]
    written = steps()
    assert written == sorted(set(written))  # one writer: no interleaved or repeated records
    probe(run_dir)  # the killed run left no stale lock


def _launch(run_dir, *overrides):
    """A 2-rank `deepspeed` launcher run in the background (its stdout and stderr piped)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for key in ("MEMORIA_DS_FAULT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    from .launch_util import free_port

    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), FINETUNE, *TINY, f"run_dir={run_dir}",
           "checkpoint.every=2", "eval.at_end=false", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _train_steps(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _saved_preset(checkpoint):
    return json.loads((checkpoint / "manifest.json").read_text())["meta"]["config"]["model"]["preset"]


@pytest.mark.parametrize("delay", [0.5, pytest.param(3.0, marks=pytest.mark.slow)])
def test_racing_runs_on_one_directory_never_overwrite_each_other(tmp_path, delay):
    """Issue 47 item 1: two launcher runs on one new directory, the second a moment later and of
    another kind. The decision to start fresh is taken under the lock, so the second is refused
    (the directory is in use, or, if the first has finished, holds checkpoints of another model):
    the directory holds one run's config, records and checkpoints."""
    run_dir = tmp_path / "run"
    first = _launch(run_dir, "optim.max_steps=8")
    time.sleep(delay)
    second = _launch(run_dir, "optim.max_steps=8", "model.preset=xl")
    outs = [p.communicate(timeout=600) for p in (first, second)]
    codes = [first.returncode, second.returncode]
    assert sorted(codes) == [0, 2], (codes, [o[1][-3000:] for o in outs])
    winner = "memoria" if codes[0] == 0 else "xl"
    loser_err = outs[codes.index(2)][1]
    assert "in use by another run" in loser_err or "different `model` configuration" in loser_err, loser_err[-3000:]
    assert f"preset: {winner}" in (run_dir / "config.yaml").read_text()
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints] == ["step_00000006", "step_00000008"]  # keep_last=2 of one run
    assert {_saved_preset(c) for c in checkpoints} == {winner}
    assert _train_steps(run_dir) == list(range(1, 9))  # one run's records, not two concatenated
    assert not (run_dir / "checkpoints" / "abandoned").exists()


@pytest.mark.slow
def test_racing_resumes_of_one_checkpoint_train_each_step_once(tmp_path):
    """Two resumes of one checkpoint a moment apart: one continues it, the other is refused or finds
    the run finished; no checkpoint is set aside as abandoned and no step is trained twice."""
    run_dir = tmp_path / "run"
    first = _launch(run_dir, "optim.max_steps=4")
    assert first.wait(timeout=600) == 0, first.communicate()[1][-3000:]
    a = _launch(run_dir, "optim.max_steps=10")
    time.sleep(0.5)
    b = _launch(run_dir, "optim.max_steps=10")
    outs = [p.communicate(timeout=600) for p in (a, b)]
    codes = [a.returncode, b.returncode]
    assert 0 in codes and set(codes) <= {0, 2}, (codes, [o[1][-3000:] for o in outs])
    assert not (run_dir / "checkpoints" / "abandoned").exists(), [o[0][-2000:] for o in outs]
    assert _train_steps(run_dir) == list(range(1, 11))


def test_a_fresh_start_sets_an_earlier_runs_records_aside(tmp_path):
    """A run killed before its first checkpoint leaves records and nothing to resume: the next run
    starts afresh and moves them into abandoned/ instead of appending its own to them."""
    run_dir = tmp_path / "run"
    killed = run_training(run_dir, fault="kill_after_step:2", launcher="python")
    assert killed.returncode == 17, killed.stderr[-3000:]
    assert _train_steps(run_dir) == [1, 2] and not (run_dir / "checkpoints").exists()
    proc = check(run_training(run_dir, launcher="python"))
    assert _train_steps(run_dir) == list(range(1, 7))  # this run's records alone
    (aside,) = (run_dir / "abandoned").iterdir()
    assert _train_steps(aside) == [1, 2] and (aside / "config.yaml").is_file()
    assert str(aside) in proc.stdout and "set them aside" in proc.stdout


def test_a_run_refused_during_set_up_leaves_no_directory(tmp_path):
    """The lock is taken before set-up reads anything; a run refused there (a training split too
    small for its streams) removes the directory it created for the lock."""
    run_dir = tmp_path / "new" / "run"
    proc = run_training(run_dir, "data.segment_length=60", "optim.micro_batch_size=4096", launcher="python")
    assert proc.returncode == 2 and "too small for this run" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "kept"
    existing.mkdir()
    proc = run_training(existing, "data.segment_length=60", "optim.micro_batch_size=4096", launcher="python")
    assert proc.returncode == 2 and existing.is_dir() and list(existing.iterdir()) == []
