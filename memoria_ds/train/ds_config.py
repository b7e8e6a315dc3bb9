"""Resolve a DeepSpeed JSON against the run configuration.

The project's DeepSpeed files stay DeepSpeed-native and small. Values written as "auto"
(which only the HF Trainer understands) are filled from the run configuration here, and
explicit values are checked against it, so that

    train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size

always holds, or the run stops before it starts with a message that says which number to
change. The learning-rate schedule belongs to the run configuration (linear, 6% warm-up):
a "scheduler" section in the JSON is refused rather than silently ignored.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from .typed import ConfigError


def read_ds_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"DeepSpeed config {str(p)!r} does not exist (the project's are in ds_configs/)")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {str(p)!r} is not valid JSON: {e}")
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {str(p)!r} must be a JSON object")
    return data


def _fill(section: dict[str, Any], key: str, value: Any, where: str) -> None:
    """section[key] = value if it is missing or "auto", else check it equals value."""
    have = section.get(key, "auto")
    if have == "auto":
        section[key] = value
    elif have != value:
        raise ConfigError(
            f"DeepSpeed config has {where}{key} = {have!r} but the run configuration gives {value!r}; "
            f"set it to \"auto\" in the JSON or make the two agree"
        )


def resolve_ds_config(
    ds: dict[str, Any],
    *,
    micro_batch_size: int,
    grad_accum: int,
    world_size: int,
    grad_clip: float,
    precision: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    device_type: str,
    nan_policy: str,
) -> dict[str, Any]:
    """A complete DeepSpeed config dict for this run.

    Args:
        ds: the JSON as read. The other arguments come from the run configuration.
        precision: "fp32", "bf16" or "fp16". device_type: "cuda" or "cpu".

    Raises:
        ConfigError: inconsistent batch sizes, fp16 on CPU, a "scheduler" section,
            a precision the JSON contradicts.
    """
    out = copy.deepcopy(ds)
    if "scheduler" in out:
        raise ConfigError(
            "DeepSpeed config has a \"scheduler\" section; memoria_ds sets the learning-rate schedule "
            "from the run configuration (optim.warmup_ratio, optim.lr): remove the section"
        )
    _fill(out, "train_micro_batch_size_per_gpu", micro_batch_size, "")
    _fill(out, "gradient_accumulation_steps", grad_accum, "")
    expected = micro_batch_size * grad_accum * world_size
    have = out.get("train_batch_size", "auto")
    if have == "auto":
        out["train_batch_size"] = expected
    elif have != expected:
        raise ConfigError(
            f"train_batch_size ({have}) != micro_batch ({micro_batch_size}) * grad_accum ({grad_accum}) * "
            f"world_size ({world_size}) = {expected}. Set train_batch_size to \"auto\" in the DeepSpeed config, "
            f"or change optim.micro_batch_size / optim.grad_accum or the number of ranks"
        )
    _fill(out, "gradient_clipping", grad_clip, "")

    if precision == "fp16" and device_type != "cuda":
        raise ConfigError("fp16 needs a GPU (DeepSpeed refuses it on CPU); use precision bf16 or fp32")
    for name in ("bf16", "fp16"):
        section = out.setdefault(name, {})
        if not isinstance(section, dict):
            raise ConfigError(f"DeepSpeed config section \"{name}\" must be an object")
        _fill(section, "enabled", precision == name, f"{name}.")
    if precision == "bf16" and nan_policy == "skip":
        # let the ZeRO optimizer skip a step whose gradient norm is not finite
        out["bf16"].setdefault("check_overflow", True)

    opt = out.get("optimizer")
    if opt is not None:
        params = opt.setdefault("params", {})
        for key, value in (("lr", lr), ("weight_decay", weight_decay), ("betas", list(betas)), ("eps", eps)):
            _fill(params, key, value, "optimizer.params.")
    zero = out.setdefault("zero_optimization", {})
    if zero.get("stage", 0) == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    out.setdefault("steps_per_print", 10**9)  # progress is ours (tqdm, TensorBoard, JSONL)
    out.setdefault("wall_clock_breakdown", False)
    return out
