"""The one boundary to DeepSpeed: build, forward, backward, step, save, load.

`TrainEngine` is what the training loop sees. `DeepSpeedEngine` wraps a real
`deepspeed.initialize` engine (ZeRO 1-3, offload, bf16/fp16/fp32); `TorchEngine` is plain
PyTorch on one process (AdamW, the same schedule, clipping, optional bf16 autocast), for
runs without DeepSpeed. Nothing else in memoria_ds imports deepspeed (a test checks it).

    base.py      TrainEngine, the schedule, parameter groups, the NaN guard
    plain.py     TorchEngine (engine: torch)
    ds.py        DeepSpeedEngine, the process group, ZeRO-3 construction, config check, versions
    ds_files.py  DeepSpeed's checkpoint files: pickle allow-list, universal conversion, fp32 masters
    ds_writes.py DeepSpeed's checkpoint writes, guarded: a failed write on one rank cannot hang the others
"""

from .base import (MAX_MEMORY_DELAY_FRACTION, TrainEngine, capped_memory_delay, constant_after, delayed_warmup_decay,
                   group_schedules, guard_loss, linear_warmup_decay, memory_groups_apart, memory_settings_idle, param_groups)
from .ds import (DeepSpeedEngine, building_under_zero3, check_ds_config, deepspeed_available, init_process_group,
                 versions, zero3_construction, zero_model_state_bytes)
from .ds_files import DEEPSPEED_PICKLE_GLOBALS, fp32_master, gathered, to_universal, zero_fp32_state_dict
from .plain import ENGINE_FILE, TorchEngine

__all__ = [
    "DEEPSPEED_PICKLE_GLOBALS", "DeepSpeedEngine", "building_under_zero3", "ENGINE_FILE", "MAX_MEMORY_DELAY_FRACTION", "TorchEngine",
    "TrainEngine", "capped_memory_delay", "check_ds_config", "constant_after",
    "deepspeed_available", "delayed_warmup_decay", "group_schedules", "fp32_master", "gathered", "guard_loss", "init_process_group", "linear_warmup_decay", "memory_groups_apart",
    "memory_settings_idle", "param_groups", "to_universal", "versions", "zero3_construction", "zero_fp32_state_dict", "zero_model_state_bytes",
]
