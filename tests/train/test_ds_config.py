"""Every file in ds_configs/ resolves, for every precision and device, to a config that
DeepSpeed's own config classes accept; batch-size arithmetic is enforced."""

from pathlib import Path

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from memoria_ds.train.config import OptimSection
from memoria_ds.train.ds_config import read_ds_config, resolve_ds_config
from memoria_ds.train.engine import check_ds_config
from memoria_ds.train.parse import ConfigError

DS_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
OPTIM = OptimSection(micro_batch_size=2, grad_accum=3, grad_clip=1.0, lr=5e-5, weight_decay=0.01,
                     betas=[0.9, 0.999], eps=1e-8)
KW = dict(world_size=4, precision="fp32", device_type="cuda")


def _resolve(ds, **kw):
    return resolve_ds_config({"zero_optimization": {"stage": 2}, **ds}, OPTIM, **dict(KW, **kw))


def _parsed(ds) -> DeepSpeedConfig:
    """DeepSpeed's parse of a resolved config, as one process (world size 1) sees it."""
    return DeepSpeedConfig(dict(ds, train_batch_size=ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]))


# The NaN policy is not an input of the DeepSpeed config (both policies rely on the engine
# skipping a step whose gradients are not finite), so precision x device covers every case.
@pytest.mark.parametrize("path", sorted(DS_DIR.glob("*.json")), ids=lambda p: p.name)
@pytest.mark.parametrize("precision,device", [("fp32", "cuda"), ("bf16", "cuda"), ("fp16", "cuda"),
                                              ("fp32", "cpu"), ("bf16", "cpu")])
def test_every_shipped_config_resolves_to_one_deepspeed_accepts(path, precision, device):
    out = _resolve(read_ds_config(path), precision=precision, device_type=device)
    assert out["train_batch_size"] == 2 * 3 * 4
    assert out["train_micro_batch_size_per_gpu"] == 2 and out["gradient_accumulation_steps"] == 3
    assert out["gradient_clipping"] == 1.0
    assert out["bf16"]["enabled"] is (precision == "bf16")
    assert out.get("fp16", {}).get("enabled", False) is (precision == "fp16")
    assert "auto" not in str(out), "every auto value is resolved"
    if "optimizer" in out:
        assert out["optimizer"]["params"]["lr"] == 5e-5 and out["optimizer"]["params"]["betas"] == [0.9, 0.999]
    assert 1 <= out["zero_optimization"]["stage"] <= 3
    check_ds_config(out)  # DeepSpeed's own classes (pydantic sections refuse unknown keys)
    parsed = _parsed(out)
    assert parsed.bfloat16_config.enabled is (precision == "bf16")
    assert parsed.float16_config.enabled is (precision == "fp16")
    assert parsed.managed_gradient_accumulation is False, "the loop owns the accumulation boundary"
    if precision == "bf16":  # the key the NaN policy relies on, as DeepSpeed reads it
        assert parsed.bfloat16_config.check_grad_overflow is True


def test_deepspeed_validation_names_a_key_it_does_not_know():
    out = _resolve(read_ds_config(DS_DIR / "zero2.json"), precision="bf16")
    out["bf16"]["check_overflow"] = True  # what an earlier version of resolve_ds_config wrote
    with pytest.raises(ConfigError, match=r"refuses the resolved config \(DeepSpeedBF16Config: check_overflow: "
                                          r"Extra inputs are not permitted\)"):
        check_ds_config(out)
    out = _resolve(read_ds_config(DS_DIR / "zero2.json"))
    out["zero_optimization"]["stage"] = "two"
    with pytest.raises(ConfigError, match="stage"):
        check_ds_config(out)


def test_inconsistent_batch_size_is_refused():
    with pytest.raises(ConfigError, match=r"train_batch_size \(16\) != micro_batch \(2\) \* grad_accum \(3\) \* world_size \(4\) = 24"):
        _resolve({"train_batch_size": 16})
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu = 8 but the run configuration gives 2"):
        _resolve({"train_micro_batch_size_per_gpu": 8})
    assert _resolve({"train_batch_size": 24, "gradient_accumulation_steps": 3})["train_batch_size"] == 24


def test_fp16_on_cpu_scheduler_and_precision_conflicts():
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        _resolve({}, precision="fp16", device_type="cpu")
    with pytest.raises(ConfigError, match="scheduler"):
        _resolve({"scheduler": {"type": "WarmupLR"}})
    with pytest.raises(ConfigError, match=r"bf16.enabled = True but the run configuration gives False"):
        _resolve({"bf16": {"enabled": True}})


def test_what_would_apply_a_non_finite_step_is_refused():
    with pytest.raises(ConfigError, match=r"bf16.check_grad_overflow = false: a step whose gradients are not finite"):
        _resolve({"bf16": {"check_grad_overflow": False}}, precision="bf16")
    assert _resolve({"bf16": {"check_grad_overflow": False}}, precision="fp32")["bf16"]["enabled"] is False
    for stage in ({}, {"stage": 0}):
        with pytest.raises(ConfigError, match=r"zero_optimization.stage = 0; memoria_ds needs ZeRO stage 1, 2 or 3"):
            _resolve({"zero_optimization": stage})


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_ds_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_ds_config(tmp_path / "bad.json")
