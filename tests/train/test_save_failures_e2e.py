"""A save that fails on one rank of several ends every rank with one clear error (issue 47 item 2).

DeepSpeed's save is collective: a write that raises on one rank used to leave it outside
DeepSpeed's barriers while the others waited there, and the job hung. The writes are now
guarded inside DeepSpeed's checkpoint engine (memoria_ds/train/engine/ds_writes.py) and the
outcome agreed by every rank (checkpoints/store.py).
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from memoria_ds.train.checkpoints import find_latest

from .launch_util import ROOT, check, losses_by_step, run_training

ZERO3 = f"deepspeed={ROOT / 'ds_configs' / 'cpu_zero3.json'}"


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error")]


@pytest.mark.parametrize("stage", ["zero2", pytest.param("zero3", marks=pytest.mark.slow)])
def test_a_full_disk_inside_deepspeeds_save_on_two_ranks_ends_both(tmp_path, stage):
    """Rank 0's ZeRO optimizer-state write fails as on a full disk (ENOSPC part-way, inside
    DeepSpeed's own `torch.save`); rank 1's writes succeed. Both ranks stop with the same error
    (exit 1, no traceback, no hang), the partial checkpoint is gone, the earlier one resumes."""
    run = tmp_path / "run"
    stage_args = [ZERO3] if stage == "zero3" else []
    proc = run_training(run, *stage_args, "checkpoint.every=2", "eval.at_end=false", ranks=2,
                        fault="disk_full_in_engine_save:4", timeout=300)
    assert proc.returncode == 1, proc.stderr[-4000:]
    lines = _errors(proc)
    assert sorted(line.split(":")[0] for line in lines) == ["error (rank 0)", "error (rank 1)"], proc.stderr[-4000:]
    for line in lines:
        assert "could not write checkpoint step_00000004" in line and "rank 0: No space left on device" in line
        assert "optim_states" in line and "step_00000002" in line
    assert "Traceback" not in proc.stderr
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002"], "no staging folder is left behind"
    check(run_training(run, *stage_args, "checkpoint.every=2", "eval.at_end=false", ranks=2))
    assert find_latest(ckpts)[0].step == 6 and max(losses_by_step(run)) == 6


@pytest.mark.slow
def test_a_checkpoint_folder_that_cannot_be_made_ends_both_ranks(tmp_path):
    """Rank 0 prepares the save's staging folder alone; where it cannot (here a file in its
    place; a read-only directory alike) every rank stops with one line, none waits forever."""
    run = tmp_path / "run"
    check(run_training(run, "optim.max_steps=2", "checkpoint.every=2", "eval.at_end=false", ranks=2))
    (run / "checkpoints" / ".staging-step_00000004").write_text("in the way")
    proc = run_training(run, "checkpoint.every=2", "eval.at_end=false", ranks=2, timeout=300)
    assert proc.returncode == 1, proc.stderr[-4000:]
    lines = _errors(proc)
    assert len(lines) == 2 and all("could not write checkpoint step_00000004" in line and "rank 0: Not a directory"
                                   in line for line in lines), proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert find_latest(run / "checkpoints")[0].step == 2


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"memoria_test_{uuid.uuid4().hex[:8]}",
                           str(path)], capture_output=True)
    return done.returncode == 0


@pytest.mark.slow
def test_a_real_full_disk_on_two_ranks(tmp_path):
    """The issue's case on a real small file system (a 90 MB tmpfs; needs the right to mount,
    else skipped): the quickstart's model with memformer fills it within a few checkpoints."""
    mount = tmp_path / "tmpfs"
    if not _mount_tmpfs(mount, "90m"):
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        proc = run_training(mount / "run", "--config", str(ROOT / "launch" / "configs" / "quickstart.yaml"),
                            f"deepspeed={ROOT / 'ds_configs' / 'cpu.json'}", "optim.memory_delay_steps=0",
                            "checkpoint.every=2", "optim.max_steps=40", "model.preset=memformer",
                            "optim.bptt_segments=2", "log.progress=false", tiny=False, ranks=2, timeout=600)
        assert proc.returncode == 1, proc.stderr[-4000:]
        lines = _errors(proc)
        assert len(lines) == 2 and all("could not write checkpoint" in line and "torch could not write the file" in
                                       line and "MiB free now" in line for line in lines), proc.stderr[-4000:]
        assert "Traceback" not in proc.stderr
        kept = find_latest(mount / "run" / "checkpoints")[0]
        assert kept is not None and not list((mount / "run" / "checkpoints").glob(".staging-*"))
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
