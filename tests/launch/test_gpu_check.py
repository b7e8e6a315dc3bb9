"""The GPU acceptance command, where no GPU is: its dry run validates every configuration it
would use (for CUDA, bf16, through DeepSpeed's own classes), and at tiny shapes the whole
check runs on CPU and writes its report: the real launcher, a kill and `--resume auto`
continuing bit-identically, ZeRO-3 + LoRA with a non-empty adapter."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def test_dry_run_validates_every_configuration():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ok = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(ok) == 6 and all("bf16 (DeepSpeed" in line for line in ok), proc.stdout
    assert sum("_compiled " in line and "zero2.json" in line for line in ok) == 2  # model.compile, ZeRO-2
    assert any("zero2.json" in line and "ZeRO-2" in line for line in ok)
    assert any("zero3.json" in line and "ZeRO-3" in line for line in ok)


def test_without_a_gpu_or_a_package_it_says_what_is_missing_in_one_line():
    proc = _run()
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("gpu_check: no CUDA device visible to torch")
    proc = _run("--only", "tests,nope")
    assert proc.returncode == 2 and "unknown part(s) ['nope']" in proc.stderr


@pytest.mark.slow
def test_the_whole_check_at_tiny_shapes(tmp_path):
    out = tmp_path / "gpu_check"
    proc = _run("--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["failures"] == []
    parts = report["parts"]
    assert list(parts) == ["probe", "memory", "model", "train", "lora", "tests"]  # the capture answers first
    assert {k: v["status"] for k, v in parts["probe"]["kinds"].items()} == {"transformer": "captured",
                                                                          "memoria": "captured"}
    assert set(parts["memory"]) >= {"B=4", "B=8"} and parts["memory"]["B=8"]["ms_per_step"] > 0
    assert set(parts["model"]["small"]) == {"transformer", "xl", "memoria", "memoria_full_width"}
    for part in ("train", "lora"):
        assert parts[part]["memoria"]["tokens_per_s"] > 0 and parts[part]["transformer"]["tokens_per_s"] > 0
    resume = parts["train"]["resume"]["memoria"]
    assert resume["bit_identical"] is True and resume["steps_compared"] == 3
    assert parts["lora"]["memoria"]["adapter"]["complete"] and parts["lora"]["memoria"]["adapter"]["tensors"] > 0
    text = (out / "report.md").read_text()
    assert "| memoria | captured |" in text and "memoria / transformer tokens/s" in text and "bit-identical to the uninterrupted run: True" in text


@pytest.mark.slow
def test_other_kinds_are_checked_by_name(tmp_path):
    """`--presets`: the baseline, then each memory kind trained, killed and resumed."""
    proc = _run("--presets", "transformer,nope")
    assert proc.returncode == 2 and "(unknown: ['nope'])" in proc.stderr.strip().splitlines()[-1]
    assert _run("--presets", "transformer").returncode == 2  # a baseline alone checks no memory
    out = tmp_path / "gpu_check"
    proc = _run("--tiny", "--out", str(out), "--only", "train", "--presets", "transformer,memorizing", "--eager-only",
                "--deterministic")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["presets"] == ["transformer", "memorizing"] and report["failures"] == [] and report["deterministic"]
    assert "deterministic=true" in (out / "logs" / "train_memorizing_resume.log").read_text().splitlines()[0]
    train = report["parts"]["train"]
    assert set(train) == {"transformer", "memorizing", "resume", "seconds"}  # no compiled runs
    assert train["resume"]["memorizing"]["bit_identical"] is True
    assert "Resume of `memorizing`" in (out / "report.md").read_text()


def test_a_budget_cuts_a_command_short_keeps_its_log_and_reports_what_was_not_reached(tmp_path):
    out = tmp_path / "gpu_check"
    proc = _run("--tiny", "--out", str(out), "--only", "probe,memory", "--budget", "3")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["budget_s"] == 3 and report["not_reached"] == ["memory"], report
    assert any(f.startswith("probe: exit 124") for f in report["failures"]), report["failures"]
    assert "TimeoutExpired: killed after" in (out / "logs" / "probe.log").read_text()
    assert "Not reached within the budget of 3 s: memory." in (out / "report.md").read_text()
