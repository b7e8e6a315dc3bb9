"""What the training loop needs from an engine, and the pieces both engines share.

Gradient accumulation is *unmanaged* (`managed_gradient_accumulation: false`, set by
`ds_config.resolve_ds_config`): `backward()` only accumulates, and `step()` is the boundary
(reduction and optimizer update), once per optimizer step whatever the number of
micro-batches. A non-finite loss is back-propagated as NaN (`guard_loss`), so the step's
own non-finite check skips the update on every rank together, with no host sync per
micro-batch and no collective left unmatched.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ..config import OptimSection


def linear_warmup_decay(total_steps: int, warmup_ratio: float, schedule: str = "linear"):
    """LR multiplier: linear warm-up over `warmup_ratio * total_steps`, then linear decay to 0
    (`schedule="linear"`) or the peak to the end (`"constant"`)."""
    warmup = max(1, int(math.ceil(warmup_ratio * total_steps))) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor


def delayed_warmup_decay(total_steps: int, warmup_ratio: float, delay: int, schedule: str = "linear"):
    """LR multiplier of modules that start learning late: 0 for the first `delay` updates, then
    `linear_warmup_decay` over the remaining `total_steps - delay` (its own warm-up, then the
    schedule to `total_steps`, with the rest). `delay` 0 is `linear_warmup_decay`."""
    if delay <= 0:
        return linear_warmup_decay(total_steps, warmup_ratio, schedule)
    late = linear_warmup_decay(max(1, total_steps - delay), warmup_ratio, schedule)

    def factor(step: int) -> float:
        return 0.0 if step < delay else late(step - delay)

    return factor


# The most of a run the memory modules may wait: at least its second half is theirs to learn in.
MAX_MEMORY_DELAY_FRACTION = 0.5


def capped_memory_delay(delay: int, update_steps: int) -> int:
    """The delay a run of `update_steps` optimizer updates applies: `optim.memory_delay_steps`,
    at most `MAX_MEMORY_DELAY_FRACTION` of the run (rounded down), so that a short run (a
    smoke test of a preset with a long delay) is not refused and its memory modules still learn.

    Args:
        delay: the configured `optim.memory_delay_steps` (>= 0).
        update_steps: the run's optimizer updates (the schedule's length, >= 1).

    Returns:
        min(delay, floor(MAX_MEMORY_DELAY_FRACTION * update_steps)).
    """
    return min(delay, int(MAX_MEMORY_DELAY_FRACTION * update_steps))


def memory_groups_apart(memory_lr_scale: float = 1.0, memory_delay_steps: int = 0) -> bool:
    """Whether the modules Memoria adds get optimizer groups of their own (their own rate or
    schedule); otherwise every parameter is in the two groups checkpoints always had."""
    return memory_lr_scale != 1.0 or memory_delay_steps > 0


def memory_settings_idle(model: nn.Module, memory_lr_scale: float = 1.0, memory_delay_steps: int = 0) -> bool:
    """Whether a memory learning-rate scale or delay is set on a model with no trainable module
    for it to act on (`transformer`, `xl`, a backbone whose memory modules are frozen)."""
    modules = model.memory_modules() if hasattr(model, "memory_modules") else []
    return (memory_groups_apart(memory_lr_scale, memory_delay_steps)
            and not any(p.requires_grad for m in modules for p in m.parameters()))


class GroupKind(NamedTuple):
    """What the parameters of one optimizer group are.

    Attributes:
        decay: matrices: AdamW's weight decay applies (biases and norm gains do not decay).
        memory: parameters of the modules the memory adds (`model.memory_modules()`), in groups of
            their own when `memory_groups_apart` (their rate `lr * memory_lr_scale`, their delay).
        values: the PKM layers' value tables (`model.pkm_value_parameters()`), in a group of their
            own when `optim.pkm_value_lr` is set: that constant rate, no weight decay (XLM's
            "Adam at 1e-3"), after the memory's delay.
    """

    decay: bool
    memory: bool
    values: bool = False


def group_layout(model: nn.Module, memory_lr_scale: float = 1.0, memory_delay_steps: int = 0,
                 pkm_value_lr: float | None = None) -> list[GroupKind]:
    """What each optimizer group `param_groups` makes holds, in order."""
    apart = memory_groups_apart(memory_lr_scale, memory_delay_steps)
    return [kind for kind, _ in _grouped(model, apart, pkm_value_lr is not None)]


def constant_after(delay: int):
    """LR multiplier of the PKM values' group: 0 for the first `delay` updates, then 1 (a constant rate)."""

    def factor(step: int) -> float:
        return 0.0 if step < delay else 1.0

    return factor


def group_schedules(model: nn.Module, optim: OptimSection, total_steps: int) -> list:
    """The LR multiplier of each optimizer group (`group_layout`'s order): the backbone's
    `linear_warmup_decay` (with `optim.schedule`); the memory modules' delayed by `optim.memory_delay_steps`, capped
    at a fraction of the run (`capped_memory_delay`); the PKM values' constant after that delay.
    The groups themselves follow the configured delay, so a capped run's checkpoints have the
    layout of an uncapped one."""
    layout = group_layout(model, optim.memory_lr_scale, optim.memory_delay_steps, optim.pkm_value_lr)
    delay = capped_memory_delay(optim.memory_delay_steps, total_steps)
    return [constant_after(delay) if kind.values else
            delayed_warmup_decay(total_steps, optim.warmup_ratio, delay if kind.memory else 0, optim.schedule)
            for kind in layout]  # fmt: skip


def _grouped(model: nn.Module, apart: bool, values_apart: bool = False) -> list[tuple[GroupKind, list[nn.Parameter]]]:
    memory_ids, value_ids = set(), set()
    if apart and hasattr(model, "memory_modules"):
        memory_ids = {id(p) for m in model.memory_modules() for p in m.parameters()}
    if values_apart and hasattr(model, "pkm_value_parameters"):
        value_ids = {id(p) for p in model.pkm_value_parameters()}
    buckets: dict[GroupKind, list[nn.Parameter]] = {}
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in value_ids:
            buckets.setdefault(GroupKind(False, True, True), []).append(p)
        else:
            # p.dim(), as checkpoints were always grouped (a ZeRO-3 partition is 1-D, so under
            # ZeRO-3 every parameter lands in the no-decay group)
            buckets.setdefault(GroupKind(p.dim() >= 2, id(p) in memory_ids), []).append(p)
    order = [GroupKind(True, False), GroupKind(False, False), GroupKind(True, True), GroupKind(False, True),
             GroupKind(False, True, True)]
    return [(kind, buckets[kind]) for kind in order if buckets.get(kind)]


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None,
                 memory_lr_scale: float = 1.0, memory_delay_steps: int = 0,
                 pkm_value_lr: float | None = None) -> list[dict[str, Any]]:
    """Trainable parameters; matrices decay, biases and norm gains do not.

    With `memory_lr_scale != 1` or `memory_delay_steps > 0`, the modules Memoria adds
    (`model.memory_modules()`) get groups of their own at `lr * memory_lr_scale` (backbone
    groups first; `group_layout` gives the order, `group_schedules` their schedules). With
    `pkm_value_lr` set and PKM layers in the model, their value tables get the last group, at
    that rate and without weight decay. Otherwise there are two groups, as checkpoints before
    these options have.
    """
    apart = memory_groups_apart(memory_lr_scale, memory_delay_steps)
    grouped = _grouped(model, apart, pkm_value_lr is not None)
    own_rates = apart or any(kind.values for kind, _ in grouped)
    groups = []
    for kind, params in grouped:
        group: dict[str, Any] = {"params": params, "weight_decay": weight_decay if kind.decay else 0.0}
        if own_rates:
            if lr is None:
                raise ValueError("param_groups needs `lr` to give the memory modules their own groups")
            group["lr"] = peak_lr(kind, lr, memory_lr_scale, pkm_value_lr)
        groups.append(group)
    return groups


def peak_lr(kind: GroupKind, lr: float, memory_lr_scale: float, pkm_value_lr: float | None) -> float:
    """The peak learning rate of a group of `kind`: `pkm_value_lr` for the PKM values, `lr * memory_lr_scale`
    for the memory modules (when apart), `lr` for the rest."""
    if kind.values:
        assert pkm_value_lr is not None
        return pkm_value_lr
    return lr * (memory_lr_scale if kind.memory else 1.0)


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

    def apply_hyperparameters(self, optim: OptimSection) -> dict[str, tuple[Any, Any]]:
        """Set the configured optimizer settings over a restored optimizer and schedule.

        A resumed run continues the saved Adam moments and the schedule's position, but the
        settings are the configuration's: a changed `optim.lr` (the peak of the schedule),
        `weight_decay`, `betas` or `eps` takes effect from the next step instead of being
        overwritten by the saved values. (The schedule's shape, warm-up and length, is always
        the configuration's: it is a function, not state.)

        Returns:
            {name: (saved, now)} for each setting that differed from the checkpoint's.
        """
        lr, weight_decay, betas, eps = optim.lr, optim.weight_decay, tuple(optim.betas), optim.eps
        opt, sched = self._optimizer_and_scheduler()
        groups = opt.param_groups
        layout = group_layout(self.module, optim.memory_lr_scale, optim.memory_delay_steps, optim.pkm_value_lr)
        if len(layout) != len(groups):
            raise RuntimeError(f"the optimizer has {len(groups)} parameter groups where the model, "
                               f"optim.memory_lr_scale, optim.memory_delay_steps and optim.pkm_value_lr give "
                               f"{len(layout)}")
        changed: dict[str, tuple[Any, Any]] = {}
        saved = {"lr": sched.base_lrs[0], "weight_decay": max(g.get("weight_decay", 0.0) for g in groups),
                 "betas": tuple(groups[0].get("betas", betas)), "eps": groups[0].get("eps", eps)}
        now = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas), "eps": eps}
        modules = [kind.memory and not kind.values for kind in layout]
        if any(modules):  # the memory modules' own groups: their scale too
            first = modules.index(True)
            saved["memory_lr_scale"] = float(f"{sched.base_lrs[first] / sched.base_lrs[0]:.12g}")
            now["memory_lr_scale"] = optim.memory_lr_scale
        if layout[-1].values:  # the PKM values' group: its rate too
            saved["pkm_value_lr"], now["pkm_value_lr"] = sched.base_lrs[-1], optim.pkm_value_lr
        for key in now:
            if saved[key] != now[key]:
                changed[key] = (saved[key], now[key])
        peaks = [peak_lr(kind, lr, optim.memory_lr_scale, optim.pkm_value_lr) for kind in layout]
        sched.base_lrs = list(peaks)
        for group, fn, peak, kind in zip(groups, sched.lr_lambdas, peaks, layout):
            group["lr"] = peak * fn(sched.last_epoch)
            group["weight_decay"] = weight_decay if kind.decay else 0.0
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
