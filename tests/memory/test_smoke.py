"""The memory runs end to end on every configuration switch and keeps its invariants."""

import pytest
import torch

from memoria_ds.memory import EMPTY, LTM, STM, WM, MemoriaConfig, MemoryState, memorize, remind


def _run(config: MemoriaConfig, steps: int, batch: int = 3, dim: int = 16, seed: int = 0) -> MemoryState:
    gen = torch.Generator().manual_seed(seed)
    state = MemoryState.empty(config, batch, dim)
    for _ in range(steps):
        wm = torch.randn(batch, config.num_wm, dim, generator=gen)
        r = remind(state, wm, config)
        w = torch.rand(r.reminded_slots.shape, generator=gen)
        memorize(state, r, w, config)
    return state


@pytest.mark.parametrize("search", ["graph", "exhaustive"])
@pytest.mark.parametrize("use_stm,use_ltm", [(True, True), (True, False), (False, True), (False, False)])
def test_invariants_after_many_steps(search, use_stm, use_ltm):
    cfg = MemoriaConfig(num_wm=4, num_stm_reminded=3, num_ltm_reminded=5, stm_capacity=8, initial_lifespan=3,
                        alpha=2.0, search_depth=3, use_stm=use_stm, use_ltm=use_ltm, search=search)
    state = _run(cfg, 40)
    kind = state.kind
    assert ((kind == WM).sum(1) == 0).all(), "no WM survives a finished step"
    assert ((kind == STM).sum(1) <= cfg.stm_capacity).all()
    alive = kind != EMPTY
    assert (state.lifespan[alive] > 0).all() and (state.lifespan[~alive] == 0).all()
    assert (state.uid[~alive] == -1).all() and (state.uid[alive] >= 0).all()
    # counts are symmetric and bounded by the diagonal among live engrams
    for b in range(state.batch_size):
        idx = alive[b].nonzero().squeeze(1)
        sub = state.counts[b][idx][:, idx].long()
        assert torch.equal(sub, sub.T)
        assert (sub <= sub.diagonal()[:, None]).all()
    assert (state.step == 40).all()
    if use_stm:
        # reminded STM engrams earn lifespan and outlive C_stm / N_wm steps; without STM
        # retrieval nothing earns lifespan before L0 runs out, so LTM may stay empty
        assert (kind == LTM).any(), "something reaches LTM when STM engrams are reminded"


@pytest.mark.parametrize("batch", [0, 1, 2])
@pytest.mark.parametrize("sizes", [dict(num_stm_reminded=0), dict(num_ltm_reminded=0), dict(search_depth=0)])
def test_any_batch_size_and_degenerate_sizes(batch, sizes):
    cfg = MemoriaConfig(**{**dict(num_wm=4, num_stm_reminded=3, num_ltm_reminded=5, stm_capacity=8,
                                  search_depth=2), **sizes})
    state = _run(cfg, 12, batch=batch, dim=8)
    assert state.batch_size == batch and (state.step == 12).all()
    if batch:
        assert ((state.kind == STM).sum(1) == cfg.stm_capacity).all(), "STM fills up to its capacity"


def test_graph_stats_by_hand():
    cfg = MemoriaConfig(num_wm=1, num_stm_reminded=1, num_ltm_reminded=1, stm_capacity=2, capacity=4)
    state = MemoryState.empty(cfg, 1, 2)
    state.kind[0] = torch.tensor([LTM, LTM, STM, EMPTY], dtype=torch.int8)
    state.counts[0] = torch.tensor([[4, 2, 0, 9], [2, 2, 1, 0], [0, 1, 5, 0], [9, 0, 0, 9]], dtype=torch.int16)
    from memoria_ds.memory import graph_stats

    g = graph_stats(state)
    # live engrams 0, 1, 2; edges (0,1), (1,0), (1,2), (2,1); slot 3 is empty (its 9s are stale)
    assert g["degree"].tolist() == [pytest.approx(4 / 3)]
    assert g["ltm_degree"].tolist() == [pytest.approx(3 / 2)]
    # weights: 2/4, 2/2, 1/2, 1/5
    assert g["edge_weight"].tolist() == [pytest.approx((0.5 + 1.0 + 0.5 + 0.2) / 4)]
