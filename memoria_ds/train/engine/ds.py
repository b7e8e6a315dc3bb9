"""DeepSpeed: the process group, ZeRO-3 construction, the engine, config checks, versions.

Every `import deepspeed` of memoria_ds is in this package (tests/train/test_engine_boundary.py
checks it); the loop sees a `TrainEngine`. Its checkpoint files are handled in ds_files.py, its
checkpoint writes guarded in ds_writes.py.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import OptimSection
from .base import TrainEngine, group_schedules, param_groups
from .ds_writes import GuardedWrites


def init_process_group(cuda: bool) -> None:
    """DeepSpeed's process group: NCCL on GPUs, gloo on CPU."""
    import deepspeed

    if not cuda:
        # DeepSpeed compiles a shared-memory comm op on first use (25-65 s on CPU);
        # gloo does the same job for CPU runs, so mark the op unavailable.
        deepspeed.ops.__compatible_ops__ = dict(deepspeed.ops.__compatible_ops__, deepspeed_shm_comm=False)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")


@contextlib.contextmanager
def zero3_construction(ds_config: dict[str, Any] | None) -> Iterator[None]:
    """Build the model inside: under ZeRO-3, HF builds / loads it straight into partitions.

    A GPT-2 XL is then never materialised whole on every rank. The HF DeepSpeed config is
    unset right after, so later model builds (the rank-0 export) do not become collective.
    Outside ZeRO-3 this does nothing.
    """
    if not ds_config or ds_config.get("zero_optimization", {}).get("stage") != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hf_ds_config = HfDeepSpeedConfig(ds_config)  # HF reads it through a weak reference while it lives
    try:
        yield
    finally:
        del hf_ds_config
        unset_hf_deepspeed_config()


def building_under_zero3() -> bool:
    """Whether a model built now is built into ZeRO-3 partitions (inside `zero3_construction`)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def versions() -> dict[str, str]:
    """The versions a checkpoint records."""
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
    except ImportError:
        out["deepspeed"] = "not installed"
    return out


class DeepSpeedEngine(TrainEngine):
    """A `deepspeed.initialize` engine behind the `TrainEngine` interface."""

    def __init__(self, model: nn.Module, ds_config: dict[str, Any], optim: OptimSection, total_steps: int) -> None:
        """`ds_config` is the resolved DeepSpeed config (batch, clipping, precision, ZeRO); `optim`
        gives the optimizer and schedule; `total_steps` is the schedule's length in updates."""
        import deepspeed

        groups = param_groups(model, optim.weight_decay, optim.lr, optim.memory_lr_scale, optim.memory_delay_steps,
                              optim.pkm_value_lr)
        optimizer = None
        if "optimizer" not in ds_config:  # no compile needed; fused kernels on CUDA
            fused = torch.cuda.is_available()
            optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, fused=fused)
        factors = group_schedules(model, optim, total_steps)
        self._engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=groups,
            optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factors),
            config=ds_config,
        )
        self.module = self._engine.module
        self.config = ds_config
        self._writes = GuardedWrites(self._engine)  # a failed write cannot leave the ranks' collectives apart

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
        """DeepSpeed's save; a write that failed on this rank is raised after it (ds_writes.py)."""
        self._writes.start()
        self._engine.save_checkpoint(str(directory), tag=tag, save_latest=False,
                                     exclude_frozen_parameters=exclude_frozen)
        self._writes.raise_failure()

    def load(self, directory: Path, tag: str, strict: bool) -> None:
        path, _ = self._engine.load_checkpoint(
            str(directory), tag=tag, load_module_strict=strict,
            load_optimizer_states=True, load_lr_scheduler_states=True,
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint at {directory}/{tag}")


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

    from ..parse import ConfigError

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
        importlib.import_module("deepspeed")
    except ImportError:
        return False
    return os.environ.get("MEMORIA_DS_NO_DEEPSPEED") != "1"


def zero_model_state_bytes(params: int, largest_layer: int, stage: int, offload: bool,
                           gpus_per_node: int, nodes: int = 1) -> dict[str, float]:
    """Weights, gradients and optimizer states per GPU (and per node on CPU), by DeepSpeed's estimators.

    ZeRO-2 and 3: `estimate_zero2/3_model_states_mem_needs` (16-bit weights, 16- and 32-bit
    gradients, fp32 master weights, Adam moments; ZeRO-3 also holds its largest layer whole,
    and is initialised partitioned). ZeRO-1 has no estimator in DeepSpeed; it is counted the
    same way with only the fp32 part partitioned: 16-bit weights and gradients whole (4 bytes
    per parameter), 16 bytes per parameter over the ranks.

    Returns:
        {"gpu": bytes per GPU, "cpu": bytes per node (offloaded states and buffers)}.
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    gpus = gpus_per_node * nodes
    if stage == 3:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            params, largest_layer, num_gpus_per_node=gpus_per_node, num_nodes=nodes, cpu_offload=offload,
            cpu_offload_params=offload, zero_init=True)
    elif stage == 2:
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus_per_node, num_nodes=nodes,
                                                         cpu_offload=offload)
    elif stage == 1 and not offload:
        gpu, cpu = 4 * params + 16 * params / gpus, 0.0
    else:
        raise ValueError(f"no estimate for ZeRO stage {stage}{' with offload' if offload else ''}")
    return {"gpu": float(gpu), "cpu": float(cpu)}
