"""The plain-PyTorch engine: one process, AdamW, the same schedule and clipping, bf16 autocast.

For runs without DeepSpeed (`engine: torch`). Its checkpoint is one safetensors file
(`ENGINE_FILE`): weights, optimizer and schedule, read back as data (no pickle).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...safe_io import load_tree, save_tree
from ..config import OptimSection
from .base import TrainEngine, group_schedules, param_groups

ENGINE_FILE = "engine.safetensors"  # the plain engine's state (weights, optimizer, schedule): no pickle


class TorchEngine(TrainEngine):
    """Plain PyTorch on one process: AdamW, the same schedule and clipping, bf16 autocast."""

    def __init__(self, model: nn.Module, device: torch.device, optim: OptimSection, total_steps: int,
                 precision: str) -> None:
        """`optim` gives the optimizer, schedule, clipping and accumulation; `total_steps` is the
        schedule's length in optimizer updates; `precision` the resolved `fp32` or `bf16`."""
        if precision == "fp16":
            raise ValueError("the plain-PyTorch engine supports fp32 and bf16; use DeepSpeed for fp16")
        self.module = model.to(device)
        self.device = device
        groups = param_groups(model, optim.weight_decay, optim.lr, optim.memory_lr_scale, optim.memory_delay_steps,
                              optim.pkm_value_lr)
        self.optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, group_schedules(model, optim, total_steps))
        self.grad_clip, self.grad_accum = optim.grad_clip, optim.grad_accum
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
        if exclude_frozen:  # frozen weights (tied names too) are the backbone's; buffers (running statistics) stay
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            module = {k: v for k, v in module.items() if k not in frozen}
        save_tree({"module": module, "optimizer": self.optimizer.state_dict(),
                   "scheduler": self.scheduler.state_dict()}, target / ENGINE_FILE)

    def load(self, directory: Path, tag: str, strict: bool) -> None:
        blob = load_tree(Path(directory) / tag / ENGINE_FILE, device=self.device)  # data only: no pickle
        self.module.load_state_dict(blob["module"], strict=strict)
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
