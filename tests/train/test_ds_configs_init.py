"""Every file in ds_configs/ builds a real DeepSpeed engine on CPU and takes a step.

The offload files need DeepSpeedCPUAdam, which DeepSpeed compiles on first use (about a
minute): they are in the slow tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from memoria_ds.train.distributed import init_distributed
from memoria_ds.train.ds_config import read_ds_config, resolve_ds_config
from memoria_ds.train.engine import DeepSpeedEngine

DS_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
FAST = ["zero1.json", "zero2.json", "zero3.json", "single_gpu.json", "cpu.json", "cpu_zero3.json"]
SLOW = ["zero2_offload.json", "zero3_offload.json"]


def test_the_lists_cover_every_file():
    assert sorted(FAST + SLOW) == sorted(p.name for p in DS_DIR.glob("*.json"))


def _one_step(name: str) -> None:
    info = init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    ds = resolve_ds_config(read_ds_config(DS_DIR / name), micro_batch_size=2, grad_accum=2, world_size=info.world_size,
                           grad_clip=1.0, precision="fp32", lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                           device_type="cpu", nan_policy="skip")
    engine = DeepSpeedEngine(model, ds, total_steps=4, warmup_ratio=0.0, lr=1e-2, weight_decay=0.0,
                             betas=(0.9, 0.999), eps=1e-8)
    before = [p.detach().clone() for p in engine.module.parameters() if p.numel()]
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    for micro in range(2):
        engine.backward((engine(x[2 * micro: 2 * micro + 2]) - y[2 * micro: 2 * micro + 2]).pow(2).mean())
    assert engine.step()
    after = [p.detach() for p in engine.module.parameters() if p.numel()]
    if ds["zero_optimization"]["stage"] < 3:  # ZeRO-3 holds partitions; a changed loss shows the step
        assert any(not torch.equal(a, b) for a, b in zip(before, after)), "the step changed the weights"
    assert engine.lr() == pytest.approx(1e-2 * 3 / 4)


@pytest.mark.parametrize("name", FAST)
def test_shipped_config_builds_and_steps(name):
    _one_step(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_offload_config_builds_and_steps(name):
    _one_step(name)
