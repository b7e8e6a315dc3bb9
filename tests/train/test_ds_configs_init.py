"""Every file in ds_configs/ builds a real DeepSpeed engine on CPU (fp32 and bf16) and takes a
step; a step that back-propagated a non-finite loss is skipped by the engine itself.

The offload files need DeepSpeedCPUAdam, which DeepSpeed compiles on first use (about a
minute): they are in the slow tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from memoria_ds.train.config import OptimSection
from memoria_ds.train.distributed import init_distributed
from memoria_ds.train.ds_config import read_ds_config, resolve_ds_config
from memoria_ds.train.engine import DeepSpeedEngine, check_ds_config, guard_loss

DS_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
FAST = ["zero1.json", "zero2.json", "zero3.json", "single_gpu.json", "cpu.json", "cpu_zero3.json"]
SLOW = ["zero2_offload.json", "zero3_offload.json"]


def test_the_lists_cover_every_file():
    assert sorted(FAST + SLOW) == sorted(p.name for p in DS_DIR.glob("*.json"))


def _engine(name: str, precision: str) -> DeepSpeedEngine:
    info = init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    optim = OptimSection(micro_batch_size=2, grad_accum=2, grad_clip=1.0, lr=1e-2)
    ds = resolve_ds_config(read_ds_config(DS_DIR / name), optim, world_size=info.world_size, precision=precision,
                           device_type="cpu")
    check_ds_config(ds)
    return DeepSpeedEngine(model, ds, optim.model_copy(update={"warmup_ratio": 0.0}), total_steps=4)


def _micro_losses(engine, x, y, poison: int | None = None):
    """Back-propagate two micro-batches through `guard_loss`, as the loop does; `poison`
    turns that micro-batch's loss into NaN."""
    for micro in range(2):
        loss = (engine(x[2 * micro: 2 * micro + 2]).float() - y[2 * micro: 2 * micro + 2]).pow(2).mean()
        if micro == poison:
            loss = loss * float("nan")
        loss, bad = guard_loss(loss, torch.tensor(2))
        assert bool(bad) is (micro == poison)
        engine.backward(loss)


def _one_step(name: str, precision: str = "fp32") -> None:
    engine = _engine(name, precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    before = [p.detach().clone() for p in engine.module.parameters() if p.numel()]
    x, y = torch.randn(4, 8, dtype=dtype), torch.randn(4, 1)
    _micro_losses(engine, x, y)
    assert engine.step()
    after = [p.detach() for p in engine.module.parameters() if p.numel()]
    if engine.zero_stage < 3:  # ZeRO-3 holds partitions; a changed loss shows the step
        assert any(not torch.equal(a, b) for a, b in zip(before, after)), "the step changed the weights"
    assert engine.lr() == pytest.approx(1e-2 * 3 / 4)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_shipped_config_builds_and_steps(name, precision):
    _one_step(name, precision)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_non_finite_micro_batch_skips_the_step_and_leaves_nothing_behind(name, precision):
    """The NaN policy's contract with the engine: a step that back-propagated a non-finite
    loss (through `guard_loss`) is not applied, on every ZeRO stage and precision, and the
    next step is clean."""
    engine = _engine(name, precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    x, y = torch.randn(4, 8, dtype=dtype), torch.randn(4, 1)
    with torch.no_grad():
        out0 = engine(x).float()
    _micro_losses(engine, x, y, poison=1)
    assert engine.step() is False, "the engine skipped the update"
    with torch.no_grad():
        out1 = engine(x).float()
    assert torch.equal(out0, out1), "the weights did not move"
    _micro_losses(engine, x, y)
    assert engine.step() is True
    with torch.no_grad():
        out2 = engine(x).float()
    assert torch.isfinite(out2).all() and not torch.equal(out1, out2), "the next step is applied and finite"


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_offload_config_builds_and_steps(name):
    _one_step(name)
