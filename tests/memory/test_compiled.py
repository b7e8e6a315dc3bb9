"""The compiled memory engine (issue 16 item 2) computes what the eager one does.

`torch.compile` runs on CPU (inductor, C++), so CI checks the compiled graphs themselves:
states, retrievals and statistics side by side with eager over many steps, past STM
overflow, LTM eviction and deaths; integers and booleans exactly, floats to rounding.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from memoria_ds.memory import COMPILE_MODES, MemoriaConfig, MemoryEngine, MemoryState

# small capacity: the LTM fills and evicts within the steps run
CFG = MemoriaConfig(num_wm=4, num_stm_reminded=3, num_ltm_reminded=3, stm_capacity=8, search_depth=2,
                    initial_lifespan=3, capacity=24)


def _assert_same(eager, compiled, what: str) -> None:
    for f in dataclasses.fields(eager):
        if not f.compare:
            continue
        a, b = getattr(eager, f.name), getattr(compiled, f.name)
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, equal_nan=True, msg=f"{what}.{f.name}")
        else:
            assert torch.equal(a, b), f"{what}.{f.name} differs"


def test_the_compiled_engine_steps_like_the_eager_one():
    gen = torch.Generator().manual_seed(0)
    B, D = 3, 16
    eager_state = MemoryState.empty(CFG, B, D)
    state = eager_state.clone()
    eager, engine = MemoryEngine(), MemoryEngine("default")
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    evicted = 0
    for step in range(12):
        wm = torch.randn(B, CFG.num_wm, D, generator=gen)
        r_eager = eager.remind(eager_state, wm, CFG)
        r = engine.remind(state, wm.clone(), CFG)
        _assert_same(r_eager, r, f"step {step} retrieval")
        _assert_same(eager_state, state, f"step {step} state after remind")
        weights = torch.rand(r.reminded_slots.shape, generator=gen)
        weights[0, 0] = float("nan")  # a non-finite weight counts as 0 in both
        s_eager = eager.memorize(eager_state, r_eager, weights, CFG)
        s = engine.memorize(state, r, weights.clone(), CFG)
        _assert_same(s_eager, s, f"step {step} stats")
        _assert_same(eager_state, state, f"step {step} state after memorize")
        evicted = int(state.evictions.sum())
    assert engine.compiled and engine.fell_back is None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames, "nothing was compiled"
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks, "a step broke its graph"
    assert evicted > 0 and int((state.kind == 3).sum()) > 0, "the steps never reached the LTM's limits"


def test_a_bad_input_raises_the_same_error_compiled():
    state = MemoryState.empty(CFG, 2, 8)
    engine = MemoryEngine("default")
    r = engine.remind(state, torch.randn(2, CFG.num_wm, 8), CFG)
    with pytest.raises(ValueError, match="weights of shape"):
        engine.memorize(state, r, torch.rand(2, 1), CFG)


def test_a_failed_compilation_falls_back_to_eager_once(monkeypatch):
    from memoria_ds.memory import compiled as compiled_module

    def no_compiler(gm, example_inputs):  # what inductor does on a machine without a C++ compiler
        raise RuntimeError("no C++ compiler")

    def broken(fn, mode):
        return torch.compile(fn, backend=no_compiler)

    monkeypatch.setattr(compiled_module, "_compiled", broken)
    state, reference = MemoryState.empty(CFG, 2, 8), MemoryState.empty(CFG, 2, 8)
    engine, eager = MemoryEngine("reduce-overhead"), MemoryEngine()
    wm, weights = torch.randn(2, CFG.num_wm, 8), torch.rand(2, CFG.num_reminded)
    with pytest.warns(RuntimeWarning, match="could not be compiled.*running it eagerly"):
        r = engine.remind(state, wm, CFG)
    assert not engine.compiled and "no C++ compiler" in engine.fell_back
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        engine.memorize(state, r, weights, CFG)
    eager.memorize(reference, eager.remind(reference, wm, CFG), weights, CFG)
    _assert_same(reference, state, "fallen-back state")


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="memory compile mode must be None or one of"):
        MemoryEngine("fast")
    assert "reduce-overhead" in COMPILE_MODES


def test_a_cudagraph_mode_marks_the_state_it_updates_in_place_as_static():
    # CUDA graph trees skip a graph that mutates an input unless the input's address is
    # static (seen on an H200: "skipping cudagraphs due to mutated inputs"); on CPU the mark
    # is all that can be checked, and the steps must still match eager
    state = MemoryState.empty(CFG, 2, 8)
    reference = state.clone()
    engine, eager = MemoryEngine("reduce-overhead"), MemoryEngine()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        wm, weights = torch.randn(2, CFG.num_wm, 8, generator=gen), torch.rand(2, CFG.num_reminded, generator=gen)
        engine.memorize(state, engine.remind(state, wm, CFG), weights, CFG)
        eager.memorize(reference, eager.remind(reference, wm, CFG), weights, CFG)
    assert engine.compiled
    marked = [n for n, t in state.tensors().items() if getattr(t, "_dynamo_static_input_type", None)]
    assert sorted(marked) == sorted(state.tensors()), f"not marked static: {set(state.tensors()) - set(marked)}"
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in state.scratch.values())
    _assert_same(reference, state, "state after compiled steps")
    plain = MemoryState.empty(CFG, 2, 8)
    MemoryEngine("default").remind(plain, torch.randn(2, CFG.num_wm, 8), CFG)
    assert not any(getattr(t, "_dynamo_static_input_type", None) for t in plain.tensors().values())


@pytest.mark.gpu
def test_on_cuda_the_engine_compiles_and_its_graphs_are_captured():
    # the H200 check of 2026-11-26 found both missing: Triton refused the int16 atomic adds
    # of the counts (the engine fell back to eager) and inductor skipped the CUDA graphs
    # of the in-place updates ("mutated inputs")
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    B, D = 3, 16
    state = MemoryState.empty(CFG, B, D, device="cuda")
    reference = state.clone()
    engine, eager = MemoryEngine("reduce-overhead"), MemoryEngine()
    gen = torch.Generator().manual_seed(0)
    for step in range(10):
        wm = torch.randn(B, CFG.num_wm, D, generator=gen).cuda()
        weights = torch.rand(B, CFG.num_reminded, generator=gen).cuda()
        r_eager = eager.remind(reference, wm, CFG)
        r = engine.remind(state, wm.clone(), CFG)
        _assert_same(r_eager, r, f"step {step} retrieval")
        eager.memorize(reference, r_eager, weights, CFG)
        engine.memorize(state, r, weights.clone(), CFG)
        _assert_same(reference, state, f"step {step} state")
    assert engine.compiled, f"fell back to eager: {engine.fell_back}"
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips, "CUDA graphs were skipped"
