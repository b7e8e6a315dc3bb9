"""DeepSpeed's checkpoint files: what their pickles may import, universal conversion, fp32 masters.

The folder `engine/` of a DeepSpeed checkpoint is DeepSpeed's own format (torch pickles).
This module is everything memoria_ds does with it besides `save` / `load` on the engine.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import torch

# The only classes DeepSpeed's checkpoint pickles import (ZeRO 1-3, fp32 / bf16, offload; found
# with torch.serialization.get_unsafe_globals_in_checkpoint): plain data classes and an enum.
# An engine file that would import anything else is refused before DeepSpeed unpickles it.
DEEPSPEED_PICKLE_GLOBALS = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # fp16 runs (a GPU's): its dynamic sibling
})


def to_universal(engine_dir: Path, out_dir: Path) -> str | None:
    """Convert a ZeRO checkpoint folder to DeepSpeed's universal checkpoint (for a new world
    size); None on success, else the end of the converter's error output."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(engine_dir),
           "--output_folder", str(out_dir), "--inject_missing_state", "--num_extract_workers", "1",
           "--num_merge_workers", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return None if done.returncode == 0 else done.stderr[-2000:]


def zero_fp32_state_dict(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """fp32 weights consolidated from a ZeRO checkpoint (unpickles DeepSpeed's files: trusted
    checkpoints only)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def fp32_master(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The optimizer's full fp32 master of a parameter (ZeRO 1-3; every rank calls)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param)


def gathered(param: torch.nn.Parameter, zero_stage: int | None):
    """The full parameter on every rank for the duration (ZeRO-3 partitions it)."""
    if zero_stage == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=None)
    return contextlib.nullcontext()
