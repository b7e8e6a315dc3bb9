"""Small hand-computed cases for every step of the memory (SPEC section 1).

Each test builds a row by hand (vectors, kinds, lifespans, uids, counts; consistent with
`uid = step * N_wm + j`, symmetric counts bounded by their diagonal), runs one step of the
engine and checks the numbers worked out in the comments. Engrams are named by uid; the
slot an engram sits in is the engine's business (the builder puts them in slots 0, 1, ...).
"""

from __future__ import annotations

import math

import pytest
import torch

from memoria_ds.memory import (
    EMPTY,
    LTM,
    STM,
    MemoriaConfig,
    MemoryState,
    log_mean_similarity,
    memorize,
    remind,
)
from memoria_ds.memory.retrieve import top_by_score


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- helpers
def config(**kw) -> MemoriaConfig:
    base = dict(num_wm=2, num_stm_reminded=2, num_ltm_reminded=2, stm_capacity=4, initial_lifespan=3.0,
                alpha=2.0, search_depth=0, capacity=16)
    base.update(kw)
    return MemoriaConfig(**base)


def build(cfg: MemoriaConfig, engrams, counts=None, dim: int = 2) -> MemoryState:
    """One row holding `engrams` = [(uid, kind, lifespan, vector)] in slots 0, 1, ...

    `counts` maps (uid_i, uid_j) -> Count[i, j]; each entry is set in both directions.
    The row's step is the one after the newest engram's creation step.
    """
    state = MemoryState.empty(cfg, 1, dim)
    for slot, (uid, kind, life, vec) in enumerate(engrams):
        v = torch.tensor(vec, dtype=torch.float32)
        state.vectors[0, slot] = v
        state.sq_norms[0, slot] = v.square().sum()
        state.kind[0, slot] = kind
        state.lifespan[0, slot] = life
        state.uid[0, slot] = uid
    slot = {e[0]: s for s, e in enumerate(engrams)}
    for (i, j), c in (counts or {}).items():
        state.counts[0, slot[i], slot[j]] = c
        state.counts[0, slot[j], slot[i]] = c
    state.step[0] = max((e[0] for e in engrams), default=-1) // cfg.num_wm + 1
    # consistency: every row is bounded by its diagonal
    n = len(engrams)
    sub = state.counts[0, :n, :n].long()
    assert (sub <= sub.diagonal()[:, None]).all(), "hand-built counts must satisfy Count[i, j] <= Count[i, i]"
    return state


def uids(state: MemoryState, slots: torch.Tensor) -> list[int]:
    return [int(state.uid[0, s]) if s >= 0 else -1 for s in slots[0].tolist()]


def alive(state: MemoryState) -> dict[int, tuple[int, float]]:
    """uid -> (kind, lifespan) of row 0."""
    return {int(u): (int(k), float(l)) for u, k, l in zip(state.uid[0], state.kind[0], state.lifespan[0]) if k != EMPTY}


def count(state: MemoryState, i: int, j: int) -> int:
    si = (state.uid[0] == i).nonzero()
    sj = (state.uid[0] == j).nonzero()
    assert len(si) == 1 and len(sj) == 1, f"uids {i}, {j} must both be alive"
    return int(state.counts[0, si[0, 0], sj[0, 0]])


def wm(*vectors) -> torch.Tensor:
    return torch.tensor([list(vectors)], dtype=torch.float32)


# --------------------------------------------------------------------------- steps 2-3: STM
# STM a=(0,0) b=(1,0) c=(3,0) d=(0,2); WM w1=(0,0), w2=(2,0). Squared distances to (w1, w2):
#   a: (0, 4)  mean exp = (1 + e^-4)/2        = 0.509158  log = -0.674997
#   b: (1, 1)  mean exp = e^-1                = 0.367879  log = -1.000000
#   c: (9, 1)  mean exp = (e^-9 + e^-1)/2     = 0.184001  log = -1.692812
#   d: (4, 8)  mean exp = (e^-4 + e^-8)/2     = 0.009326  log = -4.674997
STM_VECS = [(0.0, 0.0), (1.0, 0.0), (3.0, 0.0), (0.0, 2.0)]
WM_VECS = [(0.0, 0.0), (2.0, 0.0)]
EXPECTED_SCORES = [-0.674997, -1.0, -1.692812, -4.674997]


def test_stm_scores_match_the_hand_computed_log_mean():
    cand = torch.tensor([STM_VECS])
    w = torch.tensor([WM_VECS])
    scores = log_mean_similarity(cand, cand.square().sum(-1), w, w.square().sum(-1))
    assert torch.allclose(scores[0], torch.tensor(EXPECTED_SCORES), atol=1e-5), scores


def test_scores_do_not_underflow_far_from_the_working_memory():
    # x=(20,0), y=(21,0) vs WM (0,0),(1,0): d^2 x: (400, 361), y: (441, 400).
    # exp(-361) underflows to 0 in float32, but in log space
    #   x: -361 + log(1 + e^-39) - log 2 = -361.693147,  y: -400 + log(1 + e^-41) - log 2 = -400.693147
    cand = torch.tensor([[(20.0, 0.0), (21.0, 0.0)]])
    w = torch.tensor([[(0.0, 0.0), (1.0, 0.0)]])
    scores = log_mean_similarity(cand, cand.square().sum(-1), w, w.square().sum(-1))
    assert torch.allclose(scores[0], torch.tensor([-361.693147, -400.693147]), atol=1e-3), scores


def test_stm_top_k_by_score():
    cfg = config(num_stm_reminded=2, stm_capacity=4)
    # uids 0..3 = a, b, c, d (created at steps 0, 0, 1, 1); the WM gets uids 4, 5
    state = build(cfg, [(u, STM, 5.0, v) for u, v in enumerate(STM_VECS)])
    r = remind(state, wm(*WM_VECS), cfg)
    assert uids(state, r.wm_slots) == [4, 5]
    assert uids(state, r.stm_slots) == [0, 1], "top-2 by score: a (-0.675), b (-1.0)"
    assert uids(state, r.reminded_slots) == [0, 1, -1, -1], "M_rem = STM part, then the (empty) LTM part"


def test_stm_top_k_order_is_by_score_not_by_uid():
    cfg = config(num_stm_reminded=4, stm_capacity=4)
    # same vectors, reversed uids: d=0, c=1, b=2, a=3 -> best first a(3), b(2), c(1), d(0)
    state = build(cfg, [(3 - u, STM, 5.0, v) for u, v in enumerate(STM_VECS)])
    r = remind(state, wm(*WM_VECS), cfg)
    assert uids(state, r.stm_slots) == [3, 2, 1, 0]


def test_stm_score_ties_go_to_the_newest():
    cfg = config(num_stm_reminded=1, stm_capacity=4)
    # three identical STM engrams (exact tie): the largest uid (2) wins
    state = build(cfg, [(0, STM, 5.0, (1.0, 1.0)), (2, STM, 5.0, (1.0, 1.0)), (1, STM, 5.0, (1.0, 1.0))])
    r = remind(state, wm((0.0, 0.0), (0.0, 0.0)), cfg)
    assert uids(state, r.stm_slots) == [2]


def test_top_by_score_matches_a_plain_sort_with_negative_zero_and_infinite_scores():
    # the pick's int64 key must order exactly like (score, recency) compared as numbers:
    # negative and positive scores, -0.0 == +0.0 (a tie), exact ties, -inf padding
    gen = torch.Generator().manual_seed(0)
    pool = torch.tensor([-3.5, -1.0, -1e-30, -0.0, 0.0, 1e-30, 2.0, 7.25, float("-inf")])
    scores = pool[torch.randint(0, len(pool), (6, 40), generator=gen)]
    ranks = torch.stack([torch.randperm(40, generator=gen) for _ in range(6)]).to(torch.int32)
    pos, real = top_by_score(scores, ranks, 12)
    for b in range(6):
        plain = sorted(range(40), key=lambda i: (float(scores[b, i]), int(ranks[b, i])), reverse=True)[:12]
        assert pos[b].tolist() == plain
        assert real[b].tolist() == [float(scores[b, i]) > float("-inf") for i in plain]


def test_stm_with_fewer_engrams_than_k_reminds_them_all_and_pads():
    cfg = config(num_stm_reminded=3, stm_capacity=4)
    state = build(cfg, [(0, STM, 5.0, (3.0, 0.0)), (1, STM, 5.0, (1.0, 0.0))])  # c-like (-1.69), b-like (-1.0)
    r = remind(state, wm(*WM_VECS), cfg)
    assert uids(state, r.stm_slots) == [1, 0, -1]
    assert r.reminded_mask[0].tolist() == [True, True, False, False, False]
    assert torch.equal(r.reminded[0, 2:], torch.zeros(3, 2)), "padding positions carry zero vectors"
    # WM engrams are never STM candidates in their own step
    assert set(uids(state, r.stm_slots)) & {2, 3} == set()


def test_fresh_memory_reminds_nothing():
    for search in ("graph", "exhaustive"):
        cfg = config(search=search)
        state = MemoryState.empty(cfg, 1, 2)
        r = remind(state, wm(*WM_VECS), cfg)
        assert uids(state, r.reminded_slots) == [-1] * 4 and not r.reminded_mask.any()
        assert int(r.num_found[0]) == 0


# --------------------------------------------------------------------------- steps 4-6: LTM
@pytest.mark.parametrize("search", ["graph", "exhaustive"])
def test_empty_ltm_contributes_nothing(search):
    # SPEC section 5: the authors' code "reminds" engram 0 when LTM is empty. Here STM engram
    # 0 has strong counts (to STM engram 1), but no LTM exists: nothing may come from LTM.
    cfg = config(search=search, search_depth=2)
    state = build(cfg, [(0, STM, 5.0, (0.0, 0.0)), (1, STM, 5.0, (1.0, 0.0))], counts={(0, 0): 4, (1, 1): 4, (0, 1): 4})
    r = remind(state, wm(*WM_VECS), cfg)
    assert uids(state, r.ltm_slots) == [-1, -1]
    assert int(r.num_found[0]) == 0
    assert uids(state, r.reminded_slots) == [0, 1, -1, -1]


def test_reminded_stm_without_a_positive_edge_gives_no_entry_point():
    # STM s0 (uid 4, identical to the WM: reminded), STM s1 (uid 5, far: not reminded, K_stm = 1),
    # LTM l (uid 0). Count[s1, l] = 5 but s1 is no cue; Count[s0, l] = 0; Count[s0, s1] = 3
    # (an STM neighbour is no LTM entry point). SPEC section 5: the authors' code lets
    # un-reminded STM rows act as entry points; here nothing is found.
    cfg = config(num_stm_reminded=1, num_ltm_reminded=2, search_depth=3)
    engrams = [(0, LTM, 5.0, (0.0, 0.0)), (4, STM, 5.0, (0.0, 0.0)), (5, STM, 5.0, (9.0, 9.0))]
    counts = {(0, 0): 5, (4, 4): 3, (5, 5): 5, (5, 0): 5, (4, 5): 3}
    state = build(cfg, engrams, counts)
    r = remind(state, wm((0.0, 0.0), (0.0, 0.0)), cfg)
    assert uids(state, r.stm_slots) == [4]
    assert uids(state, r.ltm_slots) == [-1, -1] and int(r.num_found[0]) == 0

    # one co-retrieval of s0 and l is an edge: l is found and reminded
    counts[(4, 0)] = 1
    state = build(cfg, engrams, counts)
    r = remind(state, wm((0.0, 0.0), (0.0, 0.0)), cfg)
    assert uids(state, r.ltm_slots) == [0, -1] and int(r.num_found[0]) == 1


def test_entry_point_is_the_strongest_edge_and_ties_go_to_the_newest():
    # cue s (uid 4, STM); LTM l_old (uid 0) sits exactly on the WM, l_new (uid 2) far away.
    # depth 0, K_ltm = 1: only the entry point is found, whatever its score.
    cfg = config(num_stm_reminded=1, num_ltm_reminded=1, search_depth=0)
    engrams = [(0, LTM, 5.0, (0.0, 0.0)), (2, LTM, 5.0, (7.0, 7.0)), (4, STM, 5.0, (0.0, 1.0))]
    # Count[s, l_old] = Count[s, l_new] = 3: tie -> the more recently created l_new (uid 2)
    state = build(cfg, engrams, {(0, 0): 3, (2, 2): 3, (4, 4): 6, (4, 0): 3, (4, 2): 3})
    r = remind(state, wm((0.0, 0.0), (0.0, 0.0)), cfg)
    assert uids(state, r.ltm_slots) == [2] and int(r.num_found[0]) == 1
    # Count[s, l_old] = 4 > 3: the larger count wins over recency
    state = build(cfg, engrams, {(0, 0): 4, (2, 2): 3, (4, 4): 7, (4, 0): 4, (4, 2): 3})
    r = remind(state, wm((0.0, 0.0), (0.0, 0.0)), cfg)
    assert uids(state, r.ltm_slots) == [0]


def test_search_step_ties_go_to_the_newest():
    # cue s (uid 8) -> entry l0 (uid 0); from l0 two LTM neighbours with equal counts:
    # l1 (uid 2) and l2 (uid 4): the newest (uid 4) is the round-1 pick.
    cfg = config(num_stm_reminded=1, num_ltm_reminded=3, search_depth=1)
    engrams = [(0, LTM, 5.0, (0.0, 0.0)), (2, LTM, 5.0, (0.0, 0.0)), (4, LTM, 5.0, (0.0, 0.0)),
               (8, STM, 5.0, (0.0, 0.0))]
    state = build(cfg, engrams, {(0, 0): 9, (2, 2): 9, (4, 4): 9, (8, 8): 9, (8, 0): 1, (0, 2): 2, (0, 4): 2})
    r = remind(state, wm((0.0, 0.0), (0.0, 0.0)), cfg)
    assert int(r.num_found[0]) == 2
    # found {0, 4}: equal scores -> newest first
    assert uids(state, r.ltm_slots) == [4, 0, -1]


# The graph of the search tests. WM = (0,0), (0,0), so an engram at (k, 0) scores -k^2.
#   LTM  l5 uid 0 (0,0)   l1 uid 1 (1,0)   l2 uid 2 (2,0)   l3 uid 3 (3,0)   l4 uid 4 (4,0)
#   STM  s1 uid 6 (0,1)   s2 uid 7 (0,-1)  s3 uid 8 (5,5)        (K_stm = 2: s1, s2 are the cues)
# Edges (symmetric counts; every diagonal 9):
#   s1-l1 2, s2-l2 2            entry points: s1 -> l1, s2 -> l2
#   l1-l3 3, l2-l3 2            round 1: l1 -> l3 and l2 -> l3 (two walkers merge into one)
#   l3-l4 1                     round 2: l3's strongest is l1 (3), found earlier -> l4 (1)
#                               round 3: l4's only edge leads to l3, found: the walker stops
#   l1-s3 8                     l1's strongest edge leads into STM: never stepped along (LTM only)
#   s3-l5 9                     s3 is not a cue (score -50), so l5 is never found by the graph
GRAPH_ENGRAMS = [(0, LTM, 4.0, (0.0, 0.0)), (1, LTM, 4.0, (1.0, 0.0)), (2, LTM, 4.0, (2.0, 0.0)),
                 (3, LTM, 4.0, (3.0, 0.0)), (4, LTM, 4.0, (4.0, 0.0)),
                 (6, STM, 4.0, (0.0, 1.0)), (7, STM, 4.0, (0.0, -1.0)), (8, STM, 4.0, (5.0, 5.0))]
GRAPH_COUNTS = {**{(u, u): 9 for u in (0, 1, 2, 3, 4, 6, 7, 8)},
                (6, 1): 2, (7, 2): 2, (1, 3): 3, (2, 3): 2, (3, 4): 1, (1, 8): 8, (8, 0): 9}
GRAPH_WM = ((0.0, 0.0), (0.0, 0.0))  # step 5 -> WM uids 10, 11


@pytest.mark.parametrize("depth,found", [(0, 2), (1, 3), (2, 4), (3, 4), (7, 4)])
def test_depth_search_merges_walkers_excludes_found_and_stops(depth, found):
    cfg = config(num_stm_reminded=2, num_ltm_reminded=5, stm_capacity=4, search_depth=depth)
    state = build(cfg, GRAPH_ENGRAMS, GRAPH_COUNTS)
    r = remind(state, wm(*GRAPH_WM), cfg)
    # s1 and s2 tie at -1: the newer s2 (uid 7) first
    assert uids(state, r.stm_slots) == [7, 6]
    assert int(r.num_found[0]) == found, f"depth {depth}: found {{l1, l2}} + l3 (merged) + l4, then stop"
    # LTM reminded: the found engrams by score (l1 -1, l2 -4, l3 -9, l4 -16), padded to K_ltm = 5
    expected = [1, 2, 3, 4][:found]
    assert uids(state, r.ltm_slots) == expected + [-1] * (5 - found)
    assert uids(state, r.reminded_slots) == [7, 6] + expected + [-1] * (5 - found)


def test_depth_limits_a_chain():
    # chain cue -> l0 -> l1 -> l2 -> l3 (counts 1 each): depth 2 finds l0, l1, l2 only
    cfg = config(num_stm_reminded=1, num_ltm_reminded=4, search_depth=2)
    engrams = [(u, LTM, 4.0, (float(u), 0.0)) for u in range(4)] + [(8, STM, 4.0, (0.0, 0.0))]
    counts = {**{(u, u): 2 for u in (0, 1, 2, 3, 8)}, (8, 0): 1, (0, 1): 1, (1, 2): 1, (2, 3): 1}
    state = build(cfg, engrams, counts)
    r = remind(state, wm((0.0, 0.0), (0.0, 0.0)), cfg)
    assert int(r.num_found[0]) == 3
    assert uids(state, r.ltm_slots) == [0, 1, 2, -1]


def test_ltm_top_k_is_taken_among_the_found_only():
    # depth 2, K_ltm = 2: found {l1..l4}; the best two by score are l1 (-1), l2 (-4). l5 sits
    # on the WM (score 0) but is never found by the graph; `exhaustive` ranks it first.
    cfg = config(num_stm_reminded=2, num_ltm_reminded=2, search_depth=2)
    state = build(cfg, GRAPH_ENGRAMS, GRAPH_COUNTS)
    r = remind(state, wm(*GRAPH_WM), cfg)
    assert uids(state, r.ltm_slots) == [1, 2]
    cfg = config(num_stm_reminded=2, num_ltm_reminded=2, search_depth=2, search="exhaustive")
    state = build(cfg, GRAPH_ENGRAMS, GRAPH_COUNTS)
    r = remind(state, wm(*GRAPH_WM), cfg)
    assert uids(state, r.ltm_slots) == [0, 1]
    assert int(r.num_found[0]) == 5, "exhaustive: every LTM engram is a candidate"


# --------------------------------------------------------------------------- step 9a-b
def _graph_step(weights, **kw):
    """The graph row at depth 2 with K_ltm = 5: M_rem = [s2, s1, l1, l2, l3, l4, pad]."""
    cfg = config(num_stm_reminded=2, num_ltm_reminded=5, search_depth=2, **kw)
    state = build(cfg, GRAPH_ENGRAMS, GRAPH_COUNTS)
    r = remind(state, wm(*GRAPH_WM), cfg)
    if cfg.use_stm:
        assert uids(state, r.reminded_slots) == [7, 6, 1, 2, 3, 4, -1]
    stats = memorize(state, r, torch.tensor([weights], dtype=torch.float32), cfg)
    return cfg, state, r, stats


def test_counts_grow_over_all_pairs_of_wm_and_reminded_including_the_diagonal():
    # M_act = WM {10, 11} + M_rem {7, 6, 1, 2, 3, 4}: every ordered pair +1, diagonal included.
    # Slot 0 holds l5 (uid 0), not active: the padding position of M_rem must not touch it.
    _, state, _, _ = _graph_step([1, 1, 1, 1, 1, 1, 1])
    act = [10, 11, 7, 6, 1, 2, 3, 4]
    before = {**{(i, j): 0 for i in act for j in act}}
    for (i, j), c in GRAPH_COUNTS.items():
        before[(i, j)] = before[(j, i)] = c
    for i in act:
        for j in act:
            assert count(state, i, j) == before.get((i, j), 0) + 1, f"Count[{i}, {j}]"
    # e.g. Count[l1, l3] 3 -> 4, Count[l1, l1] 9 -> 10, Count[10, 10] 0 -> 1, Count[l1, l2] 0 -> 1
    assert (count(state, 1, 3), count(state, 1, 1), count(state, 10, 10), count(state, 1, 2)) == (4, 10, 1, 1)
    # engrams outside M_act keep their counts: l5 (slot 0, where padding would be clamped) and s3
    assert count(state, 0, 0) == 9 and count(state, 8, 0) == 9 and count(state, 0, 8) == 9
    assert count(state, 0, 10) == 0 and count(state, 0, 1) == 0 and count(state, 8, 8) == 9


def test_lifespan_increments_over_real_engrams_only():
    # real weights (s2, s1, l1, l2, l3, l4) = (0.5, 0.25, 0.125, 0.125, 0, -0.3 -> 0), sum 1.0;
    # the padding weight 100 is ignored. |M_rem| = 6 real engrams, alpha = 2:
    #   inc = w / 1.0 * 6 * 2 = 12 w -> s2 6.0, s1 3.0, l1 1.5, l2 1.5, l3 0, l4 0   (sum 12 = alpha * |M_rem|)
    # every engram then loses 1.0 (lifespans were 4.0; the WM starts at L0 = 3.0)
    _, state, _, stats = _graph_step([0.5, 0.25, 0.125, 0.125, 0.0, -0.3, 100.0])
    expected = {7: 9.0, 6: 6.0, 1: 4.5, 2: 4.5, 3: 3.0, 4: 3.0, 0: 3.0, 8: 3.0, 10: 2.0, 11: 2.0}
    got = {u: life for u, (_, life) in alive(state).items()}
    assert got == pytest.approx(expected, abs=1e-6)
    # lifespan statistics: mean (9+6+4.5+4.5+3*4+2*2)/10 = 4.0, max 9.0
    assert float(stats.lifespan_mean[0]) == pytest.approx(4.0) and float(stats.lifespan_max[0]) == 9.0


def test_lifespan_increment_when_weights_sum_to_zero_is_alpha_each():
    # no positive weight: every real reminded engram gets alpha = 2 (4 + 2 - 1 = 5)
    _, state, _, _ = _graph_step([0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 50.0])
    got = {u: life for u, (_, life) in alive(state).items()}
    assert got == pytest.approx({7: 5.0, 6: 5.0, 1: 5.0, 2: 5.0, 3: 5.0, 4: 5.0, 0: 3.0, 8: 3.0, 10: 2.0, 11: 2.0})


def test_non_finite_weights_at_padding_are_ignored():
    # SPEC 9b: only real reminded engrams take part; a padding position may hold anything the
    # attention produced there (e.g. NaN from a fully masked softmax). Same numbers as
    # test_lifespan_increments_over_real_engrams_only. (Found failing on 0c52f6c: the weights
    # are multiplied by the mask, NaN * 0 = NaN, so the row falls back to equal shares.)
    for garbage in (float("nan"), float("inf")):
        _, state, _, _ = _graph_step([0.5, 0.25, 0.125, 0.125, 0.0, -0.3, garbage])
        got = {u: life for u, (_, life) in alive(state).items()}
        assert got == pytest.approx({7: 9.0, 6: 6.0, 1: 4.5, 2: 4.5, 3: 3.0, 4: 3.0, 0: 3.0, 8: 3.0, 10: 2.0, 11: 2.0}), (
            f"padding weight {garbage} changed the lifespans"
        )


def test_use_stm_off_cues_search_but_are_not_reminded():
    # same graph, use_stm=False: s2, s1 still lead the search to l1..l4, but M_rem = LTM only:
    # M_rem = [l1, l2, l3, l4, pad], weights (0.25, 0.25, 0.25, 0.25), |M_rem| = 4, alpha = 2:
    # inc = 0.25 * 4 * 2 = 2.0 each -> 4 + 2 - 1 = 5; s1, s2 get nothing (4 - 1 = 3)
    cfg, state, r, _ = _graph_step([0.25, 0.25, 0.25, 0.25, 9.0], use_stm=False)
    assert uids(state, r.stm_slots) == [7, 6], "the cues are still computed"
    assert r.reminded_slots.shape[1] == 5
    got = {u: life for u, (_, life) in alive(state).items()}
    assert got == pytest.approx({7: 3.0, 6: 3.0, 1: 5.0, 2: 5.0, 3: 5.0, 4: 5.0, 0: 3.0, 8: 3.0, 10: 2.0, 11: 2.0})
    # no counts for the cues: Count[s1, l1] stays 2, Count[s1, s1] 9, Count[s1, WM] 0
    assert count(state, 6, 1) == 2 and count(state, 6, 6) == 9 and count(state, 6, 10) == 0
    assert count(state, 1, 2) == 1 and count(state, 10, 1) == 1


def test_use_ltm_off_reminds_stm_only():
    cfg = config(num_stm_reminded=2, num_ltm_reminded=5, search_depth=2, use_ltm=False)
    state = build(cfg, GRAPH_ENGRAMS, GRAPH_COUNTS)
    r = remind(state, wm(*GRAPH_WM), cfg)
    assert r.ltm_slots.shape == (1, 0) and int(r.num_found[0]) == 0
    assert uids(state, r.reminded_slots) == [7, 6]


# --------------------------------------------------------------------------- step 9c-e
def test_wm_decays_in_its_first_step():
    cfg = config(initial_lifespan=3.0)
    state = MemoryState.empty(cfg, 1, 2)
    r = remind(state, wm(*WM_VECS), cfg)
    memorize(state, r, torch.zeros(1, 4), cfg)
    assert alive(state) == {0: (STM, 2.0), 1: (STM, 2.0)}, "WM -> STM with L0 - 1 = 2.0"
    # L0 = 1: 1 - 1 = 0 <= 0, the new engrams are gone at the end of their first step
    cfg = config(initial_lifespan=1.0)
    state = MemoryState.empty(cfg, 1, 2)
    r = remind(state, wm(*WM_VECS), cfg)
    memorize(state, r, torch.zeros(1, 4), cfg)
    assert alive(state) == {}
    # L0 = 1.5 survives with 0.5
    cfg = config(initial_lifespan=1.5)
    state = MemoryState.empty(cfg, 1, 2)
    r = remind(state, wm(*WM_VECS), cfg)
    memorize(state, r, torch.zeros(1, 4), cfg)
    assert alive(state) == {0: (STM, 0.5), 1: (STM, 0.5)}


def test_removal_at_zero_or_below_and_no_stale_counts():
    # alpha = 0: no increments. Lifespans 1.0 -> 0 (removed), 1.25 -> 0.25 (kept), 0.5 -> -0.5 (removed).
    cfg = config(alpha=0.0, num_stm_reminded=3, stm_capacity=4, num_ltm_reminded=1, capacity=6)
    engrams = [(0, LTM, 1.0, (5.0, 5.0)), (1, LTM, 1.25, (6.0, 6.0)), (2, STM, 0.5, (0.0, 0.0))]
    state = build(cfg, engrams, {(0, 0): 7, (1, 1): 7, (2, 2): 7, (0, 1): 7, (0, 2): 7, (1, 2): 7})
    r = remind(state, wm(*WM_VECS), cfg)  # WM uids 2*2=4, 5
    memorize(state, r, torch.ones(r.reminded_slots.shape), cfg)
    assert alive(state) == {1: (LTM, 0.25), 4: (STM, 2.0), 5: (STM, 2.0)}
    # next step: 4 slots are free; the new WM (uids 6, 7) fill slots whose engrams died.
    # Their counts must hold exactly this step's co-retrievals, nothing left by the dead.
    r = remind(state, wm(*WM_VECS), cfg)
    assert sorted(uids(state, r.wm_slots)) == [6, 7]
    memorize(state, r, torch.ones(r.reminded_slots.shape), cfg)
    live = sorted(alive(state))
    act = set(uids(state, r.wm_slots)) | {u for u in uids(state, r.reminded_slots) if u >= 0}
    for i in (6, 7):
        for j in live:
            assert count(state, i, j) == (1 if j in act else 0), f"Count[{i}, {j}]"


def test_stm_overflow_moves_the_oldest_to_ltm():
    # N = 1, C_stm = 2, alpha = 0. STM {0, 1} + the WM 2 -> 3 STM engrams: the oldest (0) -> LTM
    cfg = config(num_wm=1, num_stm_reminded=1, num_ltm_reminded=1, stm_capacity=2, alpha=0.0, capacity=8)
    state = build(cfg, [(1, STM, 5.0, (1.0, 0.0)), (0, STM, 5.0, (0.0, 0.0))])
    r = remind(state, wm((0.0, 0.0)), cfg)
    memorize(state, r, torch.ones(r.reminded_slots.shape), cfg)
    assert {u: k for u, (k, _) in alive(state).items()} == {0: LTM, 1: STM, 2: STM}
    # N = 2, C_stm = 3: STM {0, 1, 2} + WM {6, 7} = 5 -> the two oldest (0, 1) -> LTM
    cfg = config(num_wm=2, num_stm_reminded=1, num_ltm_reminded=1, stm_capacity=3, alpha=0.0, capacity=8)
    state = build(cfg, [(2, STM, 5.0, (0.0, 0.0)), (0, STM, 5.0, (0.0, 0.0)), (1, STM, 5.0, (0.0, 0.0)),
                        (5, LTM, 5.0, (0.0, 0.0))])
    r = remind(state, wm((0.0, 0.0), (1.0, 1.0)), cfg)
    assert uids(state, r.wm_slots) == [6, 7]
    memorize(state, r, torch.ones(r.reminded_slots.shape), cfg)
    assert {u: k for u, (k, _) in alive(state).items()} == {0: LTM, 1: LTM, 2: STM, 5: LTM, 6: STM, 7: STM}


def test_stm_engrams_that_died_do_not_count_against_capacity():
    # N = 1, C_stm = 2, alpha = 0. STM uid 0 has lifespan 1.0 (dies this step), uid 1 has 5.0.
    # After the step STM = {1, 2}: exactly C_stm, nothing moves to LTM.
    cfg = config(num_wm=1, num_stm_reminded=1, num_ltm_reminded=1, stm_capacity=2, alpha=0.0, capacity=8)
    state = build(cfg, [(0, STM, 1.0, (0.0, 0.0)), (1, STM, 5.0, (1.0, 0.0))])
    r = remind(state, wm((0.0, 0.0)), cfg)
    memorize(state, r, torch.ones(r.reminded_slots.shape), cfg)
    assert alive(state) == {1: (STM, 4.0), 2: (STM, 2.0)}


# --------------------------------------------------------------------------- capacity
def test_capacity_evicts_least_lifespan_ltm_oldest_first():
    # capacity 6 = C_stm 2 + N 2 + 2. Alive: LTM 0 (2.0), 1 (1.5), 2 (1.5), 3 (1.0); STM 4 (0.5), 5 (3.0).
    # 6 alive + 2 new > 6: evict 2 LTM by (lifespan, uid): 3 (1.0), then 1 (1.5, older than 2).
    # STM 4 has the least lifespan of all but is not LTM: never evicted.
    cfg = config(num_wm=2, num_stm_reminded=1, num_ltm_reminded=1, stm_capacity=2, capacity=6, alpha=0.0)
    engrams = [(0, LTM, 2.0, (9.0, 0.0)), (1, LTM, 1.5, (9.0, 1.0)), (2, LTM, 1.5, (9.0, 2.0)),
               (3, LTM, 1.0, (9.0, 3.0)), (4, STM, 0.5, (0.0, 0.0)), (5, STM, 3.0, (0.0, 1.0))]
    counts = {**{(u, u): 3 for u in range(6)}, (1, 5): 2, (3, 4): 3}
    state = build(cfg, engrams, counts)
    r = remind(state, wm((0.0, 0.0), (0.0, 0.0)), cfg)
    assert int(r.evicted[0]) == 2 and int(state.evictions[0]) == 2
    assert sorted(alive(state)) == [0, 2, 4, 5, 6, 7]
    # the new WM engrams start with no counts (the evicted engrams' counts went with them)
    for i in (6, 7):
        for j in (0, 2, 4, 5, 6, 7):
            assert count(state, i, j) == 0 and count(state, j, i) == 0
    stats = memorize(state, r, torch.ones(r.reminded_slots.shape), cfg)
    assert int(stats.evicted[0]) == 2
    # after: 0 (1.0), 2 (0.5), 4 dies (-0.5), 5 (2.0), 6 and 7 (2.0); STM {5, 6, 7} > 2 -> 5 -> LTM
    assert alive(state) == {0: (LTM, 1.0), 2: (LTM, 0.5), 5: (LTM, 2.0), 6: (STM, 2.0), 7: (STM, 2.0)}
    assert stats.engrams[0].tolist() == [1, 0, 2, 3]
    # next step: 5 alive + 2 > 6 -> evict 1: uid 2 (0.5); the counter accumulates
    r = remind(state, wm((0.0, 0.0), (0.0, 0.0)), cfg)
    assert int(r.evicted[0]) == 1 and int(state.evictions[0]) == 3
    assert sorted(alive(state)) == [0, 5, 6, 7, 8, 9]


# --------------------------------------------------------------------------- counts storage
@pytest.mark.parametrize("dtype", ["int16", "int32"])
def test_count_saturation(dtype):
    # N = 1, K_stm = 4: M_act = WM w (uid 3, then 4) + STM i (uid 0), j (uid 1), k (uid 2) (+ uid 3).
    # i: Count[i, i] = 32767 (saturated in int16), Count[i, j] = 40
    # j: Count[j, j] = 50, Count[j, i] = 40
    # k: Count[k, k] = 32766, Count[k, j] = 30 (one below saturation)
    cfg = config(num_wm=1, num_stm_reminded=4, num_ltm_reminded=0, stm_capacity=4, alpha=1.0, capacity=8,
                 count_dtype=dtype)
    engrams = [(0, STM, 10.0, (0.0, 0.0)), (1, STM, 10.0, (0.0, 1.0)), (2, STM, 10.0, (1.0, 0.0))]
    state = build(cfg, engrams, {(0, 0): 32767, (1, 1): 50, (2, 2): 32766, (0, 1): 40, (2, 1): 30})
    for step in range(2):
        r = remind(state, wm((0.0, 0.0)), cfg)
        assert {0, 1, 2} <= set(uids(state, r.reminded_slots))  # (and, in the second step, uid 3)
        memorize(state, r, torch.ones(1, 4), cfg)
        w = 3 + step  # this step's WM uid
        if dtype == "int16":
            # row i frozen at its saturated diagonal; row k reaches 32767 in the first step, then frozen
            assert count(state, 0, 0) == 32767 and count(state, 0, 1) == 40 and count(state, 0, w) == 0
            assert count(state, 2, 2) == 32767 and count(state, 2, 1) == 31 and count(state, 2, 0) == 1
        else:
            assert count(state, 0, 0) == 32768 + step and count(state, 0, 1) == 41 + step
            assert count(state, 2, 2) == 32767 + step and count(state, 2, 1) == 31 + step
        # unsaturated rows keep counting, never wrapping
        assert count(state, 1, 1) == 51 + step and count(state, 1, 0) == 41 + step and count(state, 1, 2) == 31 + step
        assert count(state, w, w) == 1 and count(state, w, 0) == 1
        assert int(state.counts.min()) >= 0


def test_int32_counts_compare_exactly_in_the_search():
    # count_dtype="int32" stores counts beyond int16. SPEC step 4: the entry point is the LTM
    # engram with the largest count; recency only breaks exact ties. Cue s (uid 4):
    # Count[s, l_old] = 70,000,000 > Count[s, l_new] = 69,000,000 -> l_old (uid 0).
    # (Found failing on 0c52f6c: the search's int32 key `count * C + rank` clamps counts at
    # 2**30 // C - 1 = 67,108,863 for C = 16, so both counts compare equal and recency picks
    # l_new. The threshold is 645,276 at the default capacity 1664: unrealistic, but the
    # int32 option promises exact counts.)
    cfg = config(num_stm_reminded=1, num_ltm_reminded=1, search_depth=0, count_dtype="int32")
    engrams = [(0, LTM, 5.0, (0.0, 0.0)), (2, LTM, 5.0, (7.0, 7.0)), (4, STM, 5.0, (0.0, 1.0))]
    big = {(0, 0): 70_000_000, (2, 2): 69_000_000, (4, 4): 70_000_000, (4, 0): 70_000_000, (4, 2): 69_000_000}
    state = build(cfg, engrams, big)
    r = remind(state, wm((0.0, 0.0), (0.0, 0.0)), cfg)
    assert uids(state, r.ltm_slots) == [0], "the larger int32 count must win over recency"


# --------------------------------------------------------------------------- MemoriaConfig validation
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_stm_reminded=5, stm_capacity=4), r"stm_capacity.*at least.*num_stm_reminded"),
        (dict(initial_lifespan=0.0), r"initial_lifespan.*> 0"),
        (dict(initial_lifespan=-2.0), r"initial_lifespan.*> 0"),
        (dict(initial_lifespan=float("nan")), r"initial_lifespan"),
        (dict(alpha=-0.5), r"alpha.*>= 0"),
        (dict(capacity=5), r"capacity.*at least.*stm_capacity \+ num_wm.*6"),
        (dict(num_wm=0), r"num_wm.*at least 1"),
        (dict(search_depth=-1), r"search_depth.*>= 0"),
        (dict(num_ltm_reminded=-1), r"num_ltm_reminded.*>= 0"),
        (dict(stm_capacity=0, num_stm_reminded=0), r"stm_capacity.*at least 1"),
        (dict(num_wm=2.0), r"num_wm.*integer"),
        (dict(search="dfs"), r"search.*graph.*exhaustive"),
        (dict(count_dtype="int8"), r"count_dtype.*int16.*int32"),
        (dict(capacity=8.5), r"capacity.*integer"),
    ],
)
def test_config_validation_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        config(**kwargs)


def test_config_defaults_and_capacity():
    cfg = MemoriaConfig()
    # paper WikiText-103 settings (SPEC section 3)
    assert (cfg.num_wm, cfg.num_stm_reminded, cfg.num_ltm_reminded, cfg.stm_capacity) == (50, 50, 50, 400)
    assert (cfg.initial_lifespan, cfg.alpha, cfg.search_depth) == (9.0, 8.0, 10)
    # Appendix E bound: N_wm * L0 + alpha * (K_stm + K_ltm) + C_stm = 450 + 800 + 400 = 1650;
    # default capacity = the bound rounded up to a multiple of 64 = 1664 (26 * 64)
    assert cfg.steady_state_bound == 1650 and cfg.capacity == 1664
    # Table 2 sizes: 16 * 9 + 8 * 32 + 128 = 528 -> 576; enwik8: 170 * 9 + 8 * 340 + 1360 = 5610 -> 5632
    assert MemoriaConfig(num_wm=16, num_stm_reminded=16, num_ltm_reminded=16, stm_capacity=128).capacity == 576
    assert MemoriaConfig(num_wm=170, num_stm_reminded=170, num_ltm_reminded=170, stm_capacity=1360).capacity == 5632
    assert config(capacity=6, stm_capacity=4).capacity == 6  # exactly C_stm + N_wm is enough
    with pytest.raises(ValueError, match="unknown Memoria setting"):
        MemoriaConfig.from_dict({"num_wm": 2, "lifespan": 3})
    assert math.isclose(MemoriaConfig.from_dict(cfg.to_dict()).alpha, 8.0)
