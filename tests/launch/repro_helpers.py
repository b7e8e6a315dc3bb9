"""Run the reproduction launchers for real in tests: environment, ports, output checks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = str(Path(sys.executable).parent)


def env(**extra: str) -> dict[str, str]:
    """CPU, offline, one thread per rank, this interpreter's `python` and `deepspeed` first on PATH."""
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
             PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHON=sys.executable,
             PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_NODEID", "NODE_RANK",
                "MEMORIA_DS_FAULT"):
        e.pop(key, None)
    e.update(extra)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], timeout: int = 600, **env_extra: str) -> subprocess.CompletedProcess:
    """Run from the repository root; output captured."""
    return subprocess.run(cmd, cwd=ROOT, env=env(**env_extra), capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n"
                                  f"--- stderr\n{proc.stderr[-5000:]}")
    return proc


def check_finished_run(run_dir: Path, protocols: tuple[str, ...]) -> dict:
    """A run that went through the whole pipeline: config, metrics, checkpoint, export, evaluations."""
    for name in ("config.yaml", "ds_config.json", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).is_file(), f"{name} missing in {run_dir}"
    assert list((run_dir / "checkpoints").glob("step_*/manifest.json")), "no complete checkpoint"
    assert (run_dir / "export" / "config.json").is_file()
    for p in protocols:
        assert list((run_dir / "eval").glob(f"step_*_{p}.json")), f"no {p} evaluation"
    return json.loads((run_dir / "summary.json").read_text())
