"""The benchmarks' optimiser (benchmarks/recipe.py) gives the PKM layers' values the toolkit's group:
`optim.pkm_value_lr`, constant, no weight decay; a model without PKM keeps the groups it had."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench_util import load_benchmark
from transformers import GPT2Config

from memoria_ds.model import build_model

TINY = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=97, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def recipe():
    return load_benchmark("recipe.py", "recipe_under_test")


def _run(recipe, model, spec, steps=10):
    _, _, knobs = recipe.parse_variant(spec)
    a = argparse.Namespace(lr=2e-3, weight_decay=0.1, steps=steps, bptt=1)
    return recipe.optimiser(model, a, knobs)


def test_the_pkm_values_train_at_their_own_constant_rate_without_decay(recipe):
    torch.manual_seed(0)
    model = build_model(TINY, "transformer", pkm_layers=[1], pkm={"n_keys": 8, "knn": 4})
    values = {id(p) for p in model.pkm_value_parameters()}
    opt, sched = _run(recipe, model, "transformer", steps=100)
    last = opt.param_groups[-1]
    assert {id(p) for p in last["params"]} == values and last["weight_decay"] == 0.0 and last["values"]
    assert not any(id(p) in values for g in opt.param_groups[:-1] for p in g["params"])
    seen = [[g["lr"] for g in opt.param_groups]]
    for _ in range(99):
        opt.step()
        sched.step()
        seen.append([g["lr"] for g in opt.param_groups])
    assert all(lrs[-1] == 1e-3 for lrs in seen)  # constant from the first update
    peak = max(r[0] for r in seen)
    assert peak == 2e-3 and seen[0][0] < peak and seen[-1][0] < peak  # the others warm up, then decay

    opt, _ = _run(recipe, model, "transformer+opt.pkm_value_lr=None")  # with the other parameters
    assert not any(g["values"] for g in opt.param_groups)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_a_model_without_pkm_keeps_its_groups(recipe):
    model = build_model(TINY, "transformer")
    opt, _ = _run(recipe, model, "transformer")
    assert [(len(g["params"]), g["weight_decay"], g["lr"]) for g in opt.param_groups] == [
        (len(g["params"]), g["weight_decay"], 2e-3) for g in recipe.param_groups(model, 0.1)]
