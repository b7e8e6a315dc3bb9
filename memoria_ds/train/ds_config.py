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

from .config import OptimSection
from .parse import ConfigError


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
    ds: dict[str, Any], optim: OptimSection, *, world_size: int, precision: str, device_type: str
) -> dict[str, Any]:
    """A complete DeepSpeed config dict for this run.

    Args:
        ds: the JSON as read.
        optim: the run's optimiser section (batch, accumulation, clipping, AdamW settings).
        world_size: data-parallel ranks.
        precision: the resolved precision, "fp32", "bf16" or "fp16" (not "auto").
        device_type: "cuda" or "cpu".

    Raises:
        ConfigError: inconsistent batch sizes, fp16 on CPU, a "scheduler" section,
            a precision the JSON contradicts, ZeRO stage 0, `bf16.check_grad_overflow: false`.
    """
    micro_batch_size, grad_accum = optim.micro_batch_size, optim.grad_accum
    grad_clip, lr, weight_decay, betas, eps = optim.grad_clip, optim.lr, optim.weight_decay, optim.betas, optim.eps
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
    if precision == "bf16":
        # The NaN policy (both `skip` and `stop`) relies on the engine's own check: a step
        # whose gradient norm is not finite is not applied. DeepSpeed reads this key in
        # ZeRO-1/2 bf16 (fp16 always checks; fp32 and ZeRO-3 check the norm since 0.19.8).
        if out["bf16"].get("check_grad_overflow", True) is not True:
            raise ConfigError(
                "DeepSpeed config has bf16.check_grad_overflow = false: a step whose gradients are not finite would "
                "be applied (optim.nan_policy relies on the engine skipping it); remove the key"
            )
        out["bf16"]["check_grad_overflow"] = True
    zero = out.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError("DeepSpeed config section \"zero_optimization\" must be an object")
    if zero.get("stage", 0) not in (1, 2, 3):
        raise ConfigError(
            f"DeepSpeed config has zero_optimization.stage = {zero.get('stage', 0)!r}; memoria_ds needs ZeRO stage "
            "1, 2 or 3 (their optimizers skip a step whose gradients are not finite, which the NaN policy relies "
            "on; stage 0 would apply it): use ds_configs/zero1.json for plain data parallelism"
        )

    opt = out.get("optimizer")
    if opt is not None:
        params = opt.setdefault("params", {})
        for key, value in (("lr", lr), ("weight_decay", weight_decay), ("betas", list(betas)), ("eps", eps)):
            _fill(params, key, value, "optimizer.params.")
    if zero["stage"] == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    # The loop owns the accumulation boundary: backward() only accumulates, step() reduces
    # and updates (memoria_ds/train/engine.py).
    out["managed_gradient_accumulation"] = False
    out.setdefault("steps_per_print", 10**9)  # progress is ours (tqdm, TensorBoard, JSONL)
    out.setdefault("wall_clock_breakdown", False)
    return out
