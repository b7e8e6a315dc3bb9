"""`deterministic: true`: torch's deterministic mode for the run, in every rank's process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from memoria_ds.train.config import RunConfig
from memoria_ds.train.determinism import CUBLAS_WORKSPACE, make_deterministic
from memoria_ds.train.parse import ConfigError, load

from .launch_util import run_training


@pytest.fixture
def restore_mode(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark = before[1]


def test_it_turns_torchs_deterministic_mode_on(restore_mode, monkeypatch):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    make_deterministic()
    assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own setting is kept
    make_deterministic()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_the_setting_is_typed_and_off_by_default():
    assert load(RunConfig, None, []).deterministic is False
    assert load(RunConfig, None, ["deterministic=true"]).deterministic is True
    with pytest.raises(ConfigError, match="deterministic"):
        load(RunConfig, None, ["deterministic=sometimes"])


def _losses(run) -> list[float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.mark.parametrize("preset", ["memoria", pytest.param("memory_mosaic_carry", marks=pytest.mark.slow)])
def test_a_run_in_deterministic_mode_trains_as_without_it_on_cpu(tmp_path, preset):
    """Every op of the loop (the memory engine, the Mosaic's masked attention, the optimiser,
    the checkpoint) has a deterministic CPU kernel: the mode stops nothing, and a CPU step,
    already repeatable, is the same step."""
    common = [f"model.preset={preset}", "optim.max_steps=3", "checkpoint.every=0", "eval.at_end=false"]
    for name, extra in (("plain", []), ("deterministic", ["deterministic=true"])):
        proc = run_training(tmp_path / name, *common, *extra)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert ("deterministic: torch's deterministic algorithms on" in proc.stdout) == bool(extra)
    assert len(_losses(tmp_path / "plain")) == 3
    assert _losses(tmp_path / "deterministic") == _losses(tmp_path / "plain")
