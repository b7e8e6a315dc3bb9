"""Every file in ds_configs/ loads and resolves; batch-size arithmetic is enforced."""

from pathlib import Path

import pytest

from memoria_ds.train.ds_config import read_ds_config, resolve_ds_config
from memoria_ds.train.typed import ConfigError

DS_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
KW = dict(micro_batch_size=2, grad_accum=3, world_size=4, grad_clip=1.0, precision="fp32", lr=5e-5,
          weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8, device_type="cuda", nan_policy="skip")


@pytest.mark.parametrize("path", sorted(DS_DIR.glob("*.json")), ids=lambda p: p.name)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_shipped_config_resolves(path, precision):
    ds = read_ds_config(path)
    out = resolve_ds_config(ds, **dict(KW, precision=precision))
    assert out["train_batch_size"] == 2 * 3 * 4
    assert out["train_micro_batch_size_per_gpu"] == 2 and out["gradient_accumulation_steps"] == 3
    assert out["gradient_clipping"] == 1.0
    assert out["bf16"]["enabled"] is (precision == "bf16")
    assert out.get("fp16", {}).get("enabled", False) is (precision == "fp16")
    assert "auto" not in str(out), "every auto value is resolved"
    if "optimizer" in out:
        assert out["optimizer"]["params"]["lr"] == 5e-5 and out["optimizer"]["params"]["betas"] == [0.9, 0.999]
    assert 1 <= out["zero_optimization"]["stage"] <= 3


def test_inconsistent_batch_size_is_refused():
    with pytest.raises(ConfigError, match=r"train_batch_size \(16\) != micro_batch \(2\) \* grad_accum \(3\) \* world_size \(4\) = 24"):
        resolve_ds_config({"train_batch_size": 16}, **KW)
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu = 8 but the run configuration gives 2"):
        resolve_ds_config({"train_micro_batch_size_per_gpu": 8}, **KW)
    assert resolve_ds_config({"train_batch_size": 24, "gradient_accumulation_steps": 3}, **KW)["train_batch_size"] == 24


def test_fp16_on_cpu_scheduler_and_precision_conflicts():
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        resolve_ds_config({}, **dict(KW, precision="fp16", device_type="cpu"))
    with pytest.raises(ConfigError, match="scheduler"):
        resolve_ds_config({"scheduler": {"type": "WarmupLR"}}, **KW)
    with pytest.raises(ConfigError, match=r"bf16.enabled = True but the run configuration gives False"):
        resolve_ds_config({"bf16": {"enabled": True}}, **KW)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_ds_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_ds_config(tmp_path / "bad.json")


def test_bf16_skip_policy_turns_on_overflow_check():
    out = resolve_ds_config({}, **dict(KW, precision="bf16", nan_policy="skip"))
    assert out["bf16"]["check_overflow"] is True
