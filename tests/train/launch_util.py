"""Run launch/finetune.py for real: through the `deepspeed` launcher, torchrun or plain python."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FINETUNE = str(ROOT / "launch" / "finetune.py")
PRETRAIN = str(ROOT / "launch" / "pretrain.py")

# A 2-layer, 32-wide Memoria GPT-2 with a small memory, on the bundled book, 16-token segments.
TINY = [
    "model.backbone=gpt2", "model.from_scratch=true", "model.preset=memoria",
    "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, "
    "memoria: {num_wm: 4, num_stm_reminded: 4, num_ltm_reminded: 4, stm_capacity: 16, search_depth: 2}}",
    "data.corpus=bundled", "data.segment_length=16",
    "optim.micro_batch_size=2", "optim.grad_accum=1", "optim.max_steps=6", "optim.lr=1e-3", "optim.precision=fp32",
    "checkpoint.every=3", "checkpoint.export=false", "log.every=1", "log.tensorboard=false", "log.progress=false",
    "eval.max_steps=3", "eval.protocols=[full]", f"deepspeed={ROOT / 'ds_configs' / 'cpu.json'}",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_training(run_dir: Path, *overrides: str, ranks: int = 1, launcher: str = "deepspeed",
                 fault: str | None = None, timeout: int = 600, tiny: bool = True,
                 env: dict[str, str] | None = None, script: str = FINETUNE) -> subprocess.CompletedProcess:
    """Run one training job; returns the completed process (stdout/stderr captured).

    Args:
        tiny: start from the TINY settings (else only `overrides`, e.g. `--config FILE`).
        env: extra environment variables.
        script: the entry point (`FINETUNE` or `PRETRAIN`).
    """
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **(env or {}))
    env.pop("MEMORIA_DS_FAULT", None)
    if fault:
        env["MEMORIA_DS_FAULT"] = fault
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    args = [*(TINY if tiny else []), f"run_dir={run_dir}", *overrides]
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = [shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed"),
               "--num_gpus", str(ranks), "--master_port", port, script, *args]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", port, script, *args]
    else:
        assert ranks == 1
        cmd = [sys.executable, script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Fail with the job's output if it did not exit 0."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc


def metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The last logged training loss of each step (a resumed run logs steps again)."""
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


def kill_and_resume(tmp_path: Path, *overrides: str, ranks: int = 2) -> tuple[Path, Path]:
    """A 4-step run killed after step 3 and resumed from its step-2 checkpoint, beside an
    uninterrupted one: asserts steps 3 and 4 have the same losses in both (bit for bit).
    Returns the uninterrupted and the resumed run's directories."""
    from memoria_ds.train.faults import EXIT_CODE

    common = (*overrides, "optim.max_steps=4", "checkpoint.every=2", "eval.at_end=false")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    check(run_training(whole, *common, ranks=ranks))
    proc = run_training(killed, *common, ranks=ranks, fault="kill_after_step:3")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(run_training(killed, *common, "checkpoint.resume=auto", ranks=ranks))
    a = {r["step"]: r["loss"] for r in metrics(whole)}
    b = {r["step"]: r["loss"] for r in metrics(killed)}  # steps 3 (again, after the resume from 2) and 4
    assert a[3] == b[3] and a[4] == b[4], (a, b)
    return whole, killed


def move_two_ranks_to_one(tmp_path: Path, *overrides: str) -> None:
    """2 ranks for 2 steps, then 1 rank (micro-batches x2 accumulation): step 3 matches an uninterrupted
    2-rank run to reduction-order rounding (weights, Adam moments, the schedule, the memory rows
    re-sharded by stream and the stream positions carried over); steps 1-2 bit for bit."""
    from memoria_ds.train.faults import EXIT_CODE

    common = (*overrides, "optim.max_steps=3", "eval.at_end=false")
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    check(run_training(whole, *common, "checkpoint.every=1", ranks=2))
    killed = run_training(moved, *common, "checkpoint.every=2", ranks=2, fault="kill_after_step:2")
    assert killed.returncode == EXIT_CODE, killed.stderr[-3000:]
    check(run_training(moved, *common, "checkpoint.every=1", "optim.grad_accum=2", "checkpoint.resume=auto",
                       ranks=1))
    a = {r["step"]: r["loss"] for r in metrics(whole)}
    b = {r["step"]: r["loss"] for r in metrics(moved)}
    assert a[1] == b[1] and a[2] == b[2], "same two steps before the move"
    assert abs(a[3] - b[3]) < 1e-4 * abs(a[3]), f"step 3 after 2 -> 1: {b[3]} vs uninterrupted {a[3]}"


def killed_and_resumed(run, whole: Path, killed: Path, *, kill_after: int, **kw) -> tuple[dict, dict]:
    """`run(dir, *overrides, **kw)` whole, then killed after step `kill_after` and resumed (`resume=auto`):
    the two runs' training losses by step."""
    from memoria_ds.train.faults import EXIT_CODE

    check(run(whole, **kw))
    proc = run(killed, fault=f"kill_after_step:{kill_after}", **kw)
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(run(killed, "checkpoint.resume=auto", **kw))
    return losses_by_step(whole), losses_by_step(killed)
