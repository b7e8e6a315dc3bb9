"""The PKM layers' values in an optimiser group of their own (`optim.pkm_value_lr`): XLM's Adam at a
constant rate, no weight decay, after the memory's delay; and a resume that keeps the group layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memoria_ds.model import build_model
from memoria_ds.train.checkpoints.resume import check_compatible
from memoria_ds.train.checkpoints.store import CheckpointError, CheckpointInfo
from memoria_ds.train.config import OptimSection, RunConfig
from memoria_ds.train.engine import TorchEngine, param_groups
from memoria_ds.train.parse import load

PKM = {"n_keys": 8, "heads": 2, "knn": 4, "k_dim": 16}


def _model(tiny_gpt2_config, **settings):
    torch.manual_seed(0)
    return build_model(tiny_gpt2_config, "xl", pkm_layers=[1], pkm=PKM, **settings)


def _train(model, engine, steps):
    lrs = []
    for _ in range(steps):
        lrs.append([g["lr"] for g in engine.optimizer.param_groups])
        x = torch.randint(0, 257, (2, 8))
        engine.backward(model(x, labels=x).loss)
        assert engine.step()
    return lrs


def test_the_values_learn_at_their_own_constant_rate_without_decay(tiny_gpt2_config):
    model = _model(tiny_gpt2_config)
    values = model.pkm_value_parameters()
    assert [tuple(v.shape) for v in values] == [(64, 64)]
    optim = OptimSection(lr=1e-3, weight_decay=0.1, warmup_ratio=0.0, pkm_value_lr=1e-2)
    engine = TorchEngine(model, torch.device("cpu"), optim, total_steps=8, precision="fp32")
    groups = engine.optimizer.param_groups
    assert len(groups) == 3 and groups[-1]["params"] == values
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0, 0.0]
    before = values[0].detach().clone()
    lrs = _train(model, engine, 3)
    assert lrs == [[1e-3 * (8 - s) / 8] * 2 + [1e-2] for s in range(3)]  # the backbone decays, the values stay
    assert not torch.equal(values[0], before)
    assert engine.apply_hyperparameters(optim) == {}
    changed = engine.apply_hyperparameters(OptimSection(lr=1e-3, weight_decay=0.1, warmup_ratio=0.0,
                                                        pkm_value_lr=3e-3))
    assert changed == {"pkm_value_lr": (1e-2, 3e-3)} and groups[-1]["lr"] == 3e-3


def test_without_a_rate_of_their_own_the_values_train_with_the_rest(tiny_gpt2_config):
    model = _model(tiny_gpt2_config)
    groups = param_groups(model, 0.1, 1e-3, pkm_value_lr=None)
    assert len(groups) == 2 and any(p is model.pkm_value_parameters()[0] for p in groups[0]["params"])
    # a model without PKM layers keeps the two groups its checkpoints always had, whatever the rate
    plain = build_model(tiny_gpt2_config, "xl")
    assert len(param_groups(plain, 0.1, 1e-3, pkm_value_lr=1e-3)) == 2


def test_the_values_wait_for_the_memory_delay(tiny_gpt2_config):
    model = _model(tiny_gpt2_config)
    optim = OptimSection(lr=1e-3, warmup_ratio=0.0, memory_delay_steps=2, memory_lr_scale=0.5, pkm_value_lr=1e-2)
    engine = TorchEngine(model, torch.device("cpu"), optim, total_steps=8, precision="fp32")
    groups = engine.optimizer.param_groups
    memory = {id(p) for m in model.memory_modules() for p in m.parameters()}
    values = {id(p) for p in model.pkm_value_parameters()}
    kinds = [("values" if {id(p) for p in g["params"]} <= values else "memory" if {id(p) in memory for p in g["params"]}
              == {True} else "backbone") for g in groups]
    assert kinds == ["backbone", "backbone", "memory", "memory", "values"]
    lrs = _train(model, engine, 4)
    assert [step[-1] for step in lrs] == [0.0, 0.0, 1e-2, 1e-2]
    assert [step[2] for step in lrs] == pytest.approx([0.0, 0.0, 5e-4, 5e-4 * 5 / 6], rel=1e-12)


@pytest.mark.parametrize("was,now,refused", [(1e-3, None, True), (None, 1e-3, True), (1e-3, 2e-3, False)])
def test_a_resume_keeps_the_values_group(was, now, refused):
    cfg = load(RunConfig, None, ["model.preset=xl", "model.settings.pkm_layers=[1]",
                                 f"optim.pkm_value_lr={'null' if now is None else now}"])
    info = CheckpointInfo(path=Path("/nowhere/step_00000010"), step=10, world_size=1, manifest={
        "meta": {"config": {"optim": {"pkm_value_lr": was}}}})
    if refused:
        with pytest.raises(CheckpointError, match="pkm_value_lr"):
            check_compatible(info, cfg, world_size=1)
    else:  # the layout is the same: only the (fingerprinted) model decides the rest
        with pytest.raises(CheckpointError, match="different `model` configuration"):
            check_compatible(info, cfg, world_size=1)
