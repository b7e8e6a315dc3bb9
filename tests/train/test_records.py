"""Records that tell the truth (issue 17 item 7): no duplicate steps after a resume, every RNG seeded."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from memoria_ds.train.metrics import drop_records_after
from memoria_ds.train.checkpoints import seed_everything


def test_records_past_the_resumed_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"kind": "train", "step": s} for s in (1, 2, 3, 4)] + [{"kind": "eval", "step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "train", "st')  # torn by a kill
    assert drop_records_after(path, 3) == 2
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:3] + [lines[4]]
    assert drop_records_after(path, 3) == 0
    assert drop_records_after(tmp_path / "none.jsonl", 3) == 0


def test_seed_everything_seeds_python_numpy_and_torch():
    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    seed_everything(11)
    a = draw()
    seed_everything(11)
    assert draw() == a
    seed_everything(12)
    assert all(x != y for x, y in zip(draw(), a))


def test_changed_optimizer_settings_are_applied_over_a_restored_state():
    """The settings of the configuration win over the checkpoint's, at the schedule's position."""
    from memoria_ds.train.config import OptimSection
    from memoria_ds.train.engine import TorchEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    saved = OptimSection(lr=1e-3, weight_decay=0.0, betas=[0.9, 0.999], eps=1e-8, warmup_ratio=0.0)
    old = TorchEngine(model, torch.device("cpu"), saved, total_steps=10, precision="fp32")
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        old.step()
    state = {"optimizer": old.optimizer.state_dict(), "scheduler": old.scheduler.state_dict()}
    now = OptimSection(lr=5e-4, weight_decay=0.1, betas=[0.8, 0.99], eps=1e-6, warmup_ratio=0.0)
    new = TorchEngine(model, torch.device("cpu"), now, total_steps=10, precision="fp32")
    new.optimizer.load_state_dict(state["optimizer"])
    new.scheduler.load_state_dict(state["scheduler"])
    changed = new.apply_hyperparameters(now)
    assert changed == {"lr": (1e-3, 5e-4), "weight_decay": (0.0, 0.1), "betas": ((0.9, 0.999), (0.8, 0.99)),
                       "eps": (1e-8, 1e-6)}
    decay, no_decay = new.optimizer.param_groups  # matrices first (`param_groups`)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 for g in (decay, no_decay))
    assert new.lr() == decay["lr"] == 5e-4 * 7 / 10  # step 3 of a 10-step linear decay, new peak
    assert new.apply_hyperparameters(now) == {}


def test_the_memory_modules_learning_rate_scale(tiny_gpt2_config):
    """optim.memory_lr_scale: the abstractor and memory attentions get lr * scale, the backbone lr,
    through the schedule and over a restored state; 1 keeps the two groups checkpoints always had."""
    from memoria_ds.model import build_model
    from memoria_ds.train.config import OptimSection
    from memoria_ds.train.engine import TorchEngine, param_groups

    torch.manual_seed(0)
    model = build_model(tiny_gpt2_config, "memoria", memoria={"num_wm": 2, "num_stm_reminded": 2,
                                                               "num_ltm_reminded": 2, "stm_capacity": 4})
    memory = {id(p) for m in model.memory_modules() for p in m.parameters()}
    assert len(param_groups(model, 0.1)) == 2
    engine = TorchEngine(model, torch.device("cpu"), OptimSection(lr=1e-3, weight_decay=0.1, warmup_ratio=0.0,
                                                                  memory_lr_scale=0.1), total_steps=10,
                         precision="fp32")
    groups = engine.optimizer.param_groups
    assert len(groups) == 4 and sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    for g in groups:
        is_mem = {id(p) in memory for p in g["params"]}
        assert len(is_mem) == 1  # a group is all backbone or all memory
        assert g["lr"] == (1e-4 if is_mem.pop() else 1e-3)
        assert g["weight_decay"] == (0.1 if g["params"][0].dim() >= 2 else 0.0)
    x = torch.randint(0, 257, (2, 8))
    for _ in range(3):
        engine.backward(model(x, labels=x).loss)
        engine.step()
    assert [g["lr"] for g in groups] == [1e-3 * 7 / 10, 1e-3 * 7 / 10, 1e-4 * 7 / 10, 1e-4 * 7 / 10]
    changed = engine.apply_hyperparameters(OptimSection(lr=2e-3, weight_decay=0.1, warmup_ratio=0.0,
                                                        memory_lr_scale=0.5))
    assert changed == {"lr": (1e-3, 2e-3), "memory_lr_scale": (0.1, 0.5)}
    assert [g["lr"] for g in groups] == [2e-3 * 0.7, 2e-3 * 0.7, 1e-3 * 0.7, 1e-3 * 0.7]


def test_the_delayed_schedule_by_hand():
    """`delayed_warmup_decay`: 0 for `delay` updates, then the usual warm-up and decay over the rest."""
    from memoria_ds.train.engine import delayed_warmup_decay, linear_warmup_decay

    f = delayed_warmup_decay(20, 0.1, 10)  # the rest: 10 updates, a warm-up of 1, then 9 of decay
    assert [f(s) for s in range(20)] == [0.0] * 10 + [1.0] + [(10 - s) / 9 for s in range(1, 10)]
    f = delayed_warmup_decay(30, 0.2, 10)  # the rest: 20 updates, warm-up of 4, then 16 of decay
    assert [f(s) for s in range(10, 16)] == [0.25, 0.5, 0.75, 1.0, 1.0, 15 / 16]
    plain = linear_warmup_decay(30, 0.2)
    assert [delayed_warmup_decay(30, 0.2, 0)(s) for s in range(30)] == [plain(s) for s in range(30)]


def test_the_constant_schedule_by_hand():
    """`optim.schedule: constant` (the authors' classification runs): the warm-up, then the peak to the end;
    with a delay, 0 first; `linear` is unchanged."""
    from memoria_ds.train.config import OptimSection
    from memoria_ds.train.engine import delayed_warmup_decay, linear_warmup_decay

    assert [linear_warmup_decay(10, 0.2, "constant")(s) for s in range(10)] == [0.5] + [1.0] * 9
    assert [linear_warmup_decay(5, 0.0, "constant")(s) for s in range(5)] == [1.0] * 5
    assert [delayed_warmup_decay(6, 0.0, 2, "constant")(s) for s in range(6)] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert linear_warmup_decay(10, 0.0)(5) == 0.5 and OptimSection().schedule == "linear"
    from torch import nn

    from memoria_ds.train.engine import group_schedules  # what the engines' LambdaLR is given

    constant = OptimSection(schedule="constant", warmup_ratio=0.0)
    assert [f(9) for f in group_schedules(nn.Linear(2, 2), constant, 10)] == [1.0, 1.0]
    assert [f(9) for f in group_schedules(nn.Linear(2, 2), OptimSection(warmup_ratio=0.0), 10)] == [0.1, 0.1]
    with pytest.raises(ValueError):
        OptimSection(schedule="cosine")


def test_the_delay_is_capped_at_half_the_run():
    """`capped_memory_delay`: a delay longer than half the run's updates is cut to half (rounded
    down), so a short run of a preset with a long delay trains; the quickstart's 40 of 138 is
    left alone."""
    from memoria_ds.train.engine import MAX_MEMORY_DELAY_FRACTION, capped_memory_delay

    assert MAX_MEMORY_DELAY_FRACTION == 0.5
    assert capped_memory_delay(40, 138) == 40  # the quickstart's default run: untouched
    assert [capped_memory_delay(40, n) for n in (1, 2, 3, 4, 79, 80, 81)] == [0, 1, 1, 2, 39, 40, 40]
    assert capped_memory_delay(0, 1) == 0 and capped_memory_delay(5, 10) == 5 and capped_memory_delay(6, 10) == 5


def test_a_short_run_schedules_the_capped_delay(tiny_gpt2_config):
    """`group_schedules` over 2 updates with a delay of 40: the memory groups wait 1 update and
    learn at the second (a warm-up of 1 over the 1 remaining update), the backbone's schedule is
    the undelayed one; the groups stay apart as the configured delay asks (the checkpoint layout
    does not depend on the run's length)."""
    from memoria_ds.model import build_model
    from memoria_ds.train.config import OptimSection
    from memoria_ds.train.engine import group_schedules, linear_warmup_decay
    from memoria_ds.train.engine.base import group_layout

    model = build_model(tiny_gpt2_config, "memoria", memoria={"num_wm": 2, "num_stm_reminded": 2,
                                                               "num_ltm_reminded": 2, "stm_capacity": 4})
    optim = OptimSection(lr=1e-3, warmup_ratio=0.06, memory_delay_steps=40, max_steps=2)
    layout = group_layout(model, optim.memory_lr_scale, optim.memory_delay_steps)
    assert [kind.memory for kind in layout] == [False, False, True, True]
    factors = [[f(s) for s in range(2)] for f in group_schedules(model, optim, 2)]
    backbone = [linear_warmup_decay(2, 0.06)(s) for s in range(2)]
    assert backbone == [1.0, 1.0]  # a warm-up of 1, then the decay's first update (1 of 1 left)
    assert factors == [backbone, backbone, [0.0, 1.0], [0.0, 1.0]]
    # over 138 updates (the quickstart's), the configured 40
    late = group_schedules(model, optim, 138)[2]
    assert [late(s) for s in (39, 40)] == [0.0, 1 / 6]  # warm-up: ceil(0.06 * 98) = 6 updates


def test_the_memory_modules_wait_for_their_delay(tiny_gpt2_config):
    """optim.memory_delay_steps: the abstractor and memory attentions do not move for that many
    updates while the backbone does (their gradients are there, their rate is 0); then they
    learn on their own warm-up and decay."""
    from memoria_ds.model import build_model
    from memoria_ds.train.config import OptimSection
    from memoria_ds.train.engine import TorchEngine

    torch.manual_seed(0)
    model = build_model(tiny_gpt2_config, "memoria", memoria={"num_wm": 2, "num_stm_reminded": 2,
                                                               "num_ltm_reminded": 2, "stm_capacity": 4})
    memory = {id(p) for m in model.memory_modules() for p in m.parameters()}
    optim = OptimSection(lr=1e-3, warmup_ratio=0.0, memory_delay_steps=3)
    engine = TorchEngine(model, torch.device("cpu"), optim, total_steps=8, precision="fp32")
    groups = engine.optimizer.param_groups
    assert len(groups) == 4
    is_mem = [{id(p) in memory for p in g["params"]} == {True} for g in groups]
    assert is_mem == [False, False, True, True]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 257, (2, 8))
    lrs, memory_state = [], None
    for step in range(5):
        lrs.append([g["lr"] for g in groups])
        out = model(x, labels=x, memory=memory_state)  # the memory carried: its modules get gradients
        memory_state = out.memory
        engine.backward(out.loss)
        if step == 2:  # the memory modules do get gradients during the delay: it is their rate that is 0
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if id(p) in memory)
        assert engine.step()
        if step == 2:  # after 3 updates: the backbone moved, the memory modules did not
            moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
            memory_names = {n for n, p in model.named_parameters() if id(p) in memory}
            assert moved and not moved & memory_names
    assert lrs[:3] == [[1e-3 * (8 - s) / 8] * 2 + [0.0, 0.0] for s in range(3)]
    assert lrs[3] == [1e-3 * 5 / 8] * 2 + [1e-3, 1e-3] and lrs[4] == [1e-3 * 4 / 8] * 2 + [1e-3 * 4 / 5] * 2
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n]) and id(p) in memory}
    assert moved  # the memory learns once its delay is over
    # over a restored state: the same rates (the schedules are the engine's, built from the config)
    assert engine.apply_hyperparameters(optim) == {}
    assert [g["lr"] for g in groups] == pytest.approx([1e-3 * 3 / 8] * 2 + [1e-3 * 3 / 5] * 2, rel=1e-12)


def test_memory_settings_on_a_model_without_memory_modules_are_named_idle(tiny_gpt2_config):
    """A memory rate or delay does nothing on `transformer` / `xl` or on frozen memory modules;
    the run says so (setup's note) instead of silently ignoring it."""
    from memoria_ds.model import build_model
    from memoria_ds.train.engine import memory_settings_idle

    sizes = {"num_wm": 2, "num_stm_reminded": 2, "num_ltm_reminded": 2, "stm_capacity": 4}
    memoria = build_model(tiny_gpt2_config, "memoria", memoria=sizes)
    for preset in ("transformer", "xl"):
        plain = build_model(tiny_gpt2_config, preset)
        assert memory_settings_idle(plain, memory_delay_steps=5) and memory_settings_idle(plain, 0.1)
        assert not memory_settings_idle(plain)  # nothing set: nothing to say
    assert not memory_settings_idle(memoria, memory_delay_steps=5) and not memory_settings_idle(memoria, 0.1)
    for m in memoria.memory_modules():
        m.requires_grad_(False)
    assert memory_settings_idle(memoria, memory_delay_steps=5)
