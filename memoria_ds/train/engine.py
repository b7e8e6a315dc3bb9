"""The one boundary to DeepSpeed: build, forward, backward, step, save, load.

`TrainEngine` is what the training loop sees. `DeepSpeedEngine` wraps a real
`deepspeed.initialize` engine (ZeRO 1-3, offload, bf16/fp16/fp32); `TorchEngine` is plain
PyTorch on one process (AdamW, the same schedule, clipping, optional bf16 autocast), for
runs without DeepSpeed. Nothing else in memoria_ds imports deepspeed.

Gradient accumulation is *unmanaged* (`managed_gradient_accumulation: false`, set by
`ds_config.resolve_ds_config`): `backward()` only accumulates, and `step()` is the boundary
(reduction and optimizer update), once per optimizer step whatever the number of
micro-batches. A non-finite loss is back-propagated as NaN (`guard_loss`), so the step's
own non-finite check skips the update on every rank together, with no host sync per
micro-batch and no collective left unmatched.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..safe_io import load_tree, save_tree

ENGINE_FILE = "engine.safetensors"  # the plain engine's state (weights, optimizer, schedule): no pickle

# The only classes DeepSpeed's checkpoint pickles import (ZeRO 1-3, fp32 / bf16, offload; found
# with torch.serialization.get_unsafe_globals_in_checkpoint): plain data classes and an enum.
# An engine file that would import anything else is refused before DeepSpeed unpickles it.
DEEPSPEED_PICKLE_GLOBALS = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # fp16 runs (a GPU's): its dynamic sibling
})


def linear_warmup_decay(total_steps: int, warmup_ratio: float):
    """LR multiplier: linear warm-up over `warmup_ratio * total_steps`, then linear decay to 0."""
    warmup = max(1, int(math.ceil(warmup_ratio * total_steps))) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters; matrices decay, biases and norm gains do not."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def guard_loss(loss: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss to back-propagate, and whether it was non-finite, without a host sync.

    A finite loss is returned times exactly 1.0 (the same value and gradients, bit for bit).
    A non-finite one (an infinite loss can have finite gradients) is turned into NaN, so that
    every gradient it reaches is NaN and the engine's own check at `step()` (DeepSpeed's ZeRO
    optimizers, `TorchEngine.step`) skips the update. This is how the NaN policy is decided
    once per optimizer step instead of with a `.item()` per micro-batch. A micro-batch with
    no scored token (its mean loss is 0/0) is not a bad one: it contributes a zero loss, whose
    gradients are exact zeros.

    Args:
        loss: the micro-batch's mean loss (0-dim).
        scored: the number of scored tokens behind it (0-dim).

    Returns:
        (loss for backward, 0-dim bool tensor: True if a scored loss was not finite).
    """
    has = scored > 0
    bad = ~torch.isfinite(loss.detach()) & has
    return torch.where(has, loss * torch.where(bad, float("nan"), 1.0), 0.0), bad


class TrainEngine(ABC):
    """What the training loop needs from an engine."""

    module: nn.Module

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @abstractmethod
    def forward(self, *args, **kwargs): ...

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def step(self) -> bool:
        """Apply the accumulated gradients; False if the update was skipped because they were
        not finite (their norm is checked once per step; the gradients are then dropped)."""

    @abstractmethod
    def lr(self) -> float: ...

    @abstractmethod
    def grad_norm(self) -> float | None: ...

    @abstractmethod
    def save(self, directory: Path, tag: str, exclude_frozen: bool) -> None:
        """Write weights, optimizer and scheduler state to `directory/tag` (every rank calls)."""

    @abstractmethod
    def load(self, directory: Path, tag: str, strict: bool) -> None: ...

    def _optimizer_and_scheduler(self) -> tuple[Any, Any]:
        raise NotImplementedError

    def apply_hyperparameters(self, lr: float, weight_decay: float, betas: tuple[float, float],
                              eps: float) -> dict[str, tuple[Any, Any]]:
        """Set the configured optimizer settings over a restored optimizer and schedule.

        A resumed run continues the saved Adam moments and the schedule's position, but the
        settings are the configuration's: a changed `optim.lr` (the peak of the schedule),
        `weight_decay`, `betas` or `eps` takes effect from the next step instead of being
        overwritten by the saved values. (The schedule's shape, warm-up and length, is always
        the configuration's: it is a function, not state.)

        Returns:
            {name: (saved, now)} for each setting that differed from the checkpoint's.
        """
        opt, sched = self._optimizer_and_scheduler()
        groups = opt.param_groups
        changed: dict[str, tuple[Any, Any]] = {}
        saved = {"lr": sched.base_lrs[0], "weight_decay": max(g.get("weight_decay", 0.0) for g in groups),
                 "betas": tuple(groups[0].get("betas", betas)), "eps": groups[0].get("eps", eps)}
        now = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas), "eps": eps}
        for key in now:
            if saved[key] != now[key]:
                changed[key] = (saved[key], now[key])
        sched.base_lrs = [lr] * len(sched.base_lrs)
        # `param_groups` puts the decaying matrices first when there are any (ZeRO-3 keeps the
        # full shape of a partitioned parameter in `ds_shape`)
        has_matrices = any(len(getattr(p, "ds_shape", p.shape)) >= 2 for p in self.module.parameters()
                           if p.requires_grad)
        for i, (group, fn) in enumerate(zip(groups, sched.lr_lambdas)):
            group["lr"] = lr * fn(sched.last_epoch)
            group["weight_decay"] = weight_decay if i == 0 and has_matrices else 0.0
            if "betas" in group:
                group["betas"] = tuple(betas)
            if "eps" in group:
                group["eps"] = eps
        sched._last_lr = [g["lr"] for g in groups]
        return changed

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()


class DeepSpeedEngine(TrainEngine):
    """A `deepspeed.initialize` engine behind the `TrainEngine` interface."""

    def __init__(self, model: nn.Module, ds_config: dict[str, Any], total_steps: int, warmup_ratio: float,
                 lr: float, weight_decay: float, betas: tuple[float, float], eps: float) -> None:
        import deepspeed

        groups = param_groups(model, weight_decay)
        optimizer = None
        if "optimizer" not in ds_config:  # no compile needed; fused kernels on CUDA
            fused = torch.cuda.is_available()
            optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)
        factor = linear_warmup_decay(total_steps, warmup_ratio)
        self._engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=groups,
            optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
            config=ds_config,
        )
        self.module = self._engine.module
        self.config = ds_config

    @property
    def zero_stage(self) -> int:
        return self._engine.zero_optimization_stage()

    def _optimizer_and_scheduler(self) -> tuple[Any, Any]:
        return self._engine.optimizer, self._engine.lr_scheduler

    def forward(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self._engine.backward(loss)

    def step(self) -> bool:
        self._engine.step()
        return self._engine.was_step_applied()

    def lr(self) -> float:
        return float(self._engine.get_lr()[0])

    def grad_norm(self) -> float | None:
        norm = self._engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def save(self, directory: Path, tag: str, exclude_frozen: bool) -> None:
        self._engine.save_checkpoint(str(directory), tag=tag, save_latest=False,
                                     exclude_frozen_parameters=exclude_frozen)

    def load(self, directory: Path, tag: str, strict: bool) -> None:
        path, _ = self._engine.load_checkpoint(
            str(directory), tag=tag, load_module_strict=strict,
            load_optimizer_states=True, load_lr_scheduler_states=True,
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint at {directory}/{tag}")


class TorchEngine(TrainEngine):
    """Plain PyTorch on one process: AdamW, the same schedule and clipping, bf16 autocast."""

    def __init__(self, model: nn.Module, device: torch.device, total_steps: int, warmup_ratio: float, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float, grad_clip: float, grad_accum: int,
                 precision: str) -> None:
        if precision == "fp16":
            raise ValueError("the plain-PyTorch engine supports fp32 and bf16; use DeepSpeed for fp16")
        self.module = model.to(device)
        self.device = device
        self.optimizer = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, linear_warmup_decay(total_steps, warmup_ratio))
        self.grad_clip, self.grad_accum = grad_clip, grad_accum
        self.autocast = precision == "bf16"
        self._norm: float | None = None

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> bool:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else float("inf"))
        self._norm = float(norm)
        if not math.isfinite(self._norm):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _optimizer_and_scheduler(self) -> tuple[Any, Any]:
        return self.optimizer, self.scheduler

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def grad_norm(self) -> float | None:
        return self._norm

    def save(self, directory: Path, tag: str, exclude_frozen: bool) -> None:
        target = Path(directory) / tag
        target.mkdir(parents=True, exist_ok=True)
        module = {k: v for k, v in self.module.state_dict().items()}
        if exclude_frozen:
            trainable = {n for n, p in self.module.named_parameters() if p.requires_grad}
            module = {k: v for k, v in module.items() if k in trainable}
        save_tree({"module": module, "optimizer": self.optimizer.state_dict(),
                   "scheduler": self.scheduler.state_dict()}, target / ENGINE_FILE)

    def load(self, directory: Path, tag: str, strict: bool) -> None:
        blob = load_tree(Path(directory) / tag / ENGINE_FILE, device=self.device)  # data only: no pickle
        self.module.load_state_dict(blob["module"], strict=strict)
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])


def check_ds_config(ds_config: dict[str, Any]) -> str:
    """Validate a resolved DeepSpeed config with DeepSpeed's own config classes.

    `deepspeed.initialize` builds the same `DeepSpeedConfig` (whose sections are pydantic
    models that refuse unknown keys and wrong types); doing it here stops a bad config
    before any data or model work. The batch sizes are our own arithmetic
    (`ds_config.resolve_ds_config`); they are restated for the world size DeepSpeed sees in
    this process, so a config for N ranks can be checked in a single process.

    Returns:
        The installed DeepSpeed version.

    Raises:
        ConfigError: DeepSpeed refuses the config (the message names the key).
    """
    import deepspeed
    import deepspeed.comm as ds_dist
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger as ds_logger
    from pydantic import ValidationError

    from .typed import ConfigError

    try:
        seen_world = ds_dist.get_world_size()
    except (AssertionError, RuntimeError, AttributeError):
        seen_world = 1
    probe = dict(ds_config, train_batch_size=ds_config["train_micro_batch_size_per_gpu"]
                 * ds_config["gradient_accumulation_steps"] * seen_world)
    level = ds_logger.level
    ds_logger.setLevel("WARNING")
    try:
        DeepSpeedConfig(probe)
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"DeepSpeed {deepspeed.__version__} refuses the resolved config ({e.title}: {where}); fix the "
                          f"DeepSpeed JSON") from None
    except (ValueError, AssertionError, KeyError, TypeError) as e:
        raise ConfigError(f"DeepSpeed {deepspeed.__version__} refuses the resolved config: {e}") from None
    finally:
        ds_logger.setLevel(level)
    return deepspeed.__version__


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("MEMORIA_DS_NO_DEEPSPEED") != "1"
