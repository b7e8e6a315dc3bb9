"""Weights & Biases logging (issue 18 item 5): opt-in, offline without network, the same scalars as
metrics.jsonl, one W&B run per run directory (continued on resume). Through the real launcher."""

from __future__ import annotations

import glob

from .launch_util import check, metrics, run_training


def _history(run_dir) -> list[dict]:
    """Every history record W&B wrote (offline), read back with W&B's own datastore reader."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    out = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "*.wandb"))):
        ds = datastore.DataStore()
        ds.open_for_scan(path)
        while (data := ds.scan_data()) is not None:
            rec = pb.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): float(i.value_json) for i in rec.history.item
                            if i.value_json not in ('"NaN"', "NaN")})
    return out


def test_wandb_offline_gets_the_same_scalars_and_one_run_per_directory(tmp_path):
    run = tmp_path / "run"
    check(run_training(run, "log.wandb=true", "log.wandb_mode=offline", "optim.max_steps=3", "checkpoint.every=3",
                       "eval.at_end=false", env={"WANDB_SILENT": "true"}))
    run_id = (run / "wandb_id").read_text().strip()
    history = _history(run)
    train = metrics(run)
    assert [int(h["_step"]) for h in history] == [r["step"] for r in train] == [1, 2, 3]
    for h, r in zip(history, train):
        assert h["train/loss"] == r["loss"] and h["train/lr"] == r["lr"] and h["memory/ltm"] == r["memory/ltm"]

    # resumed: the same W&B run id, the new steps only
    check(run_training(run, "log.wandb=true", "log.wandb_mode=offline", "optim.max_steps=5", "checkpoint.every=3",
                       "eval.at_end=false", env={"WANDB_SILENT": "true"}))
    assert (run / "wandb_id").read_text().strip() == run_id
    dirs = glob.glob(str(run / "wandb" / "offline-run-*"))
    assert len(dirs) == 2 and all(d.endswith(run_id) for d in dirs)
    assert [int(h["_step"]) for h in _history(run)] == [1, 2, 3, 4, 5]


def test_wandb_without_the_package_is_a_configuration_error(monkeypatch):
    import importlib.util

    import pytest

    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.parse import ConfigError, load

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb=true. needs the wandb package: pip install wandb"):
        load(RunConfig, None, ["log.wandb=true"])
    assert load(RunConfig, None, []).log.wandb is False  # off by default: nothing needed
