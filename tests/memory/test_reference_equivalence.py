"""The batched engine against the slow per-row reference (tests/memory/reference.py).

Every configuration runs B >= 3 rows for 200+ random steps, with random per-row resets
(so rows sit at different fill levels) and random attention weights. Every step compares,
per row and through uids (slots are the engine's business):

* the WM uids, the evictions (which engrams, how many), the alive engrams right after
  the WM is written;
* the reminded STM and LTM engrams and their order, M_rem as handed to the model
  (vectors and mask), the number of LTM engrams found;
* after `memorize`: the alive engrams per kind, their vectors, lifespans (within 1e-5),
  the counts among live engrams (exactly), the step counter, the eviction counter and
  the MemoryStats of the step.

Precision. The engine ranks in float32, the reference in float64. Integer vectors with
small entries and N_wm <= 2 make every squared distance exact and every distinct score
at least 5e-4 away from any other (checked on every selection); equal distance multisets
are exact ties, which exercises the uid tie rule. Weights are non-negative integers whose
sum is a power of two, or all equal (plus clamped negatives, all-zero rows and garbage at
padding positions), so every lifespan increment, and every lifespan, is exact in float32
too and the lifespans agree bit for bit (the test asserts it). One configuration uses continuous
vectors, N_wm = 4 and float weights; there the test re-draws a step's WM when two scores
that decide a selection lie within 1e-4 of each other, and re-draws the weights when a
lifespan would end a step within 1e-4 of 0.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from memoria_ds.memory import EMPTY, MemoriaConfig, MemoryState, memorize, remind


def _load_reference():
    """tests/memory/reference.py under a name no other test directory can shadow."""
    name = "memoria_ds_tests_memory_reference"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("reference.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


ref_mod = _load_reference()
ReferenceMemory = ref_mod.ReferenceMemory
KIND_CODES = ref_mod.KIND_CODES

SCORE_GAP = 1e-4  # distinct scores that decide a selection must be at least this far apart
LIFE_TOL = 1e-5
GARBAGE = (1.0e6, -7.0, 123.25, 0.5, 3.0)  # weights put at padding positions: must be ignored


# --------------------------------------------------------------------------- data
def draw_vectors(gen: torch.Generator, shape: tuple[int, ...], data: str) -> torch.Tensor:
    if data == "bits":  # {0, 1}: squared distances 0..D
        return torch.randint(0, 2, shape, generator=gen).float()
    if data == "trits":  # {-1, 0, 1}: squared distances 0..4D
        return torch.randint(-1, 2, shape, generator=gen).float()
    if data == "normal":
        return 0.7 * torch.randn(shape, generator=gen)
    if data == "normal_repeats":  # continuous vectors from a pool of 10: many bit-identical engrams
        pool = 0.7 * torch.randn((10, shape[-1]), generator=torch.Generator().manual_seed(1234))
        return pool[torch.randint(0, 10, shape[:-1], generator=gen)]
    raise ValueError(data)


def dyadic_weights(rng: random.Random, n: int) -> list[float]:
    """n weights whose positive part sums to a power of two (or all <= 0: equal shares)."""
    if n == 0:
        return []
    if rng.random() < 0.08:  # nothing positive: every engram gets alpha
        return [rng.choice((0.0, -1.0)) for _ in range(n)]
    total = rng.choice((4, 8, 16))
    parts = [0] * n
    for _ in range(total):
        parts[rng.randrange(n)] += 1
    out = [float(p) for p in parts]
    if rng.random() < 0.3:  # negative weights count as 0
        out = [w if w > 0 or rng.random() < 0.5 else -2.5 for w in out]
    return out


def coarse_weights(rng: random.Random, n: int) -> list[float]:
    """Often equal weights (every engram gets exactly alpha: many equal lifespans), else dyadic."""
    if n and rng.random() < 0.6:
        return [rng.choice((1.0, 0.25))] * n
    return dyadic_weights(rng, n)


def float_weights(rng: random.Random, n: int) -> list[float]:
    """Continuous float32 weights (sometimes with zeros and negatives)."""
    out = [float(torch.tensor(rng.random(), dtype=torch.float32)) for _ in range(n)]
    if rng.random() < 0.2:
        out = [w if rng.random() < 0.7 else rng.choice((0.0, -0.25)) for w in out]
    return out


def boundary_gap_ok(rank: list[int], scores: dict[int, float], k: int) -> bool:
    """False if two distinct scores that decide the top-k (and its order) are closer than SCORE_GAP."""
    deciding = rank[: k + 1]
    if len(rank) > k:  # and every candidate ranked lower whose score is as close to the boundary
        deciding += [u for u in rank[k + 1 :] if scores[u] > scores[rank[k]] - SCORE_GAP]
    distinct = sorted({scores[u] for u in deciding})  # exact ties (equal scores) are decided by uid
    return all(b - a >= SCORE_GAP for a, b in zip(distinct, distinct[1:]))


def retrieval_is_sharp(cfg: MemoriaConfig, rr) -> bool:
    return boundary_gap_ok(rr.stm_ranking, rr.scores, cfg.num_stm_reminded) and boundary_gap_ok(
        rr.ltm_ranking, rr.scores, cfg.num_ltm_reminded
    )


# --------------------------------------------------------------------------- engine views
def engine_row(state: MemoryState, b: int) -> dict[int, tuple[int, int, float]]:
    """uid -> (slot, kind code, lifespan) for the alive engrams of row b."""
    out = {}
    kind, uid, life = state.kind[b].tolist(), state.uid[b].tolist(), state.lifespan[b].tolist()
    for slot, (k, u, l) in enumerate(zip(kind, uid, life)):
        if k != EMPTY:
            assert u >= 0, f"row {b} slot {slot}: alive engram (kind {k}) without a uid"
            assert u not in out, f"row {b}: uid {u} in two slots"
            out[u] = (slot, k, l)
    return out


def slots_to_uids(state: MemoryState, b: int, slots: list[int]) -> list[int]:
    """Slots (-1 = padding) to uids (-1 = padding)."""
    uid = state.uid[b]
    return [int(uid[s]) if s >= 0 else -1 for s in slots]


def real_then_padding(seq: list[int], what: str) -> list[int]:
    real = [u for u in seq if u >= 0]
    assert seq == real + [-1] * (len(seq) - len(real)), f"{what}: padding (-1) must come after the real engrams: {seq}"
    return real


def lifespan_close(a: float, b: float) -> bool:
    return abs(a - b) <= LIFE_TOL


# --------------------------------------------------------------------------- the runner
@dataclass
class Coverage:
    """What a run actually exercised (asserted per configuration)."""

    steps: int = 0
    resets: int = 0
    evictions: int = 0
    stm_reminded: int = 0
    ltm_reminded: int = 0
    ltm_padding_with_found: int = 0  # steps where K_ltm > found > 0
    deep_picks: int = 0  # picks in search rounds >= 1
    merged_walkers: int = 0  # walkers that landed on an engram another walker also picked
    stopped_walkers: int = 0  # walkers with nowhere to go
    score_ties: int = 0  # selections decided by the uid tie rule
    eviction_ties: int = 0  # evictions decided by the uid tie rule (equal lifespans)
    max_alive: int = 0  # most engrams alive in one row after a step
    equal_shares: int = 0  # rows whose weights summed to 0
    deaths_of_reminded: int = 0
    redraw_wm: int = 0
    redraw_weights: int = 0
    max_life_err: float = 0.0


def tie_at_boundary(rank: list[int], scores: dict[int, float], k: int) -> bool:
    prefix = rank[: k + 1]
    return any(scores[a] == scores[b] for a, b in zip(prefix, prefix[1:]))


def run_equivalence(
    cfg: MemoriaConfig, *, steps: int = 200, batch: int = 3, dim: int = 6, data: str = "bits",
    weights: str = "dyadic", reset_p: tuple[float, ...] = (0.0, 0.02, 0.06), seed: int = 0,
) -> Coverage:
    assert batch >= 3 and len(reset_p) == batch
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    state = MemoryState.empty(cfg, batch, dim)
    refs = [ReferenceMemory(cfg) for _ in range(batch)]
    cov = Coverage()
    exact_data = not data.startswith("normal")
    cues_defined = cfg.use_stm or (cfg.use_ltm and cfg.search == "graph" and cfg.num_ltm_reminded > 0)

    for t in range(steps):
        # ---- random per-row resets
        mask = [rng.random() < p for p in reset_p]
        if any(mask):
            state.reset(torch.tensor(mask))
            for b, m in enumerate(mask):
                if m:
                    refs[b].reset()
                    cov.resets += 1

        # ---- the working memory (re-drawn where continuous scores would be too close)
        wm = draw_vectors(gen, (batch, cfg.num_wm, dim), data)
        rrs = []
        for b in range(batch):
            cov.eviction_ties += _eviction_tie(refs[b])
            for attempt in range(100):
                trial = copy.deepcopy(refs[b]) if not exact_data else refs[b]
                rr = trial.remind(wm[b].tolist())
                if retrieval_is_sharp(cfg, rr):
                    break
                assert not exact_data, (
                    f"step {t} row {b}: integer data produced two distinct scores within {SCORE_GAP}; "
                    "the data design is wrong"
                )
                cov.redraw_wm += 1
                wm[b] = draw_vectors(gen, (cfg.num_wm, dim), data)
            else:
                raise AssertionError("could not draw a working memory with well-separated scores")
            refs[b] = trial
            rrs.append(rr)

        # ---- the engine's retrieve stage
        before = state.step.clone()
        r = remind(state, wm, cfg)

        def where(b: int) -> str:
            return f"[{cfg_name(cfg)} step {t} row {b} (row step {int(before[b])})]"

        for b, rr in enumerate(rrs):
            w = where(b)
            assert slots_to_uids(state, b, r.wm_slots[b].tolist()) == rr.wm, f"{w} WM uids"
            assert int(r.evicted[b]) == len(rr.evicted), (
                f"{w} evictions: engine {int(r.evicted[b])}, reference {len(rr.evicted)} ({rr.evicted})"
            )
            eng = engine_row(state, b)
            ref_kinds = {u: KIND_CODES[k] for u, k in refs[b].kinds().items()}
            assert {u: v[1] for u, v in eng.items()} == ref_kinds, (
                f"{w} alive engrams after writing the WM (uid -> kind) differ; engine - ref: "
                f"{sorted(set(eng) - set(ref_kinds))}, ref - engine: {sorted(set(ref_kinds) - set(eng))}"
            )
            # STM reminded (the cues), in order
            stm_uids = slots_to_uids(state, b, r.stm_slots[b].tolist())
            if cues_defined:
                real = real_then_padding(stm_uids, f"{w} stm_slots")
                assert real == rr.stm, (
                    f"{w} STM reminded: engine {real}, reference {rr.stm} "
                    f"(scores {[round(rr.scores[u], 6) for u in rr.stm_ranking[: cfg.num_stm_reminded + 1]]})"
                )
            # LTM reminded, in order
            ltm_uids = slots_to_uids(state, b, r.ltm_slots[b].tolist())
            real_ltm = real_then_padding(ltm_uids, f"{w} ltm_slots")
            assert real_ltm == rr.ltm, (
                f"{w} LTM reminded: engine {real_ltm}, reference {rr.ltm} (found {sorted(rr.found)}, "
                f"entry points {sorted(rr.entry_points)}, rounds {[sorted(x) for x in rr.rounds]})"
            )
            assert r.ltm_slots.shape[1] == (cfg.num_ltm_reminded if cfg.use_ltm else 0)
            expected_found = len(rr.found) if rr.ltm_retrieval else 0
            assert int(r.num_found[b]) == expected_found, (
                f"{w} LTM engrams found: engine {int(r.num_found[b])}, reference {expected_found} "
                f"(rounds {[sorted(x) for x in rr.rounds]})"
            )
            # M_rem as handed to the model
            rem_uids = slots_to_uids(state, b, r.reminded_slots[b].tolist())
            parts = (stm_uids if cfg.use_stm else []) + (ltm_uids if cfg.use_ltm else [])
            assert rem_uids == parts, f"{w} reminded_slots must be the STM part then the LTM part"
            assert [u for u in rem_uids if u >= 0] == rr.reminded, f"{w} M_rem"
            assert r.reminded_mask[b].tolist() == [u >= 0 for u in rem_uids], f"{w} reminded_mask"
            for p, u in enumerate(rem_uids):
                expected = refs[b].engrams[u].vector if u >= 0 else (0.0,) * dim
                assert r.reminded[b, p].tolist() == list(expected), f"{w} reminded vector at position {p} (uid {u})"
            # coverage
            cov.evictions += len(rr.evicted)
            cov.stm_reminded += len(rr.stm) if cfg.use_stm else 0
            cov.ltm_reminded += len(rr.ltm)
            if 0 < len(rr.found) < cfg.num_ltm_reminded:
                cov.ltm_padding_with_found += 1
            if rr.rounds:
                cov.deep_picks += sum(len(x) for x in rr.rounds[1:])
                for picks in rr.picks[1:]:
                    real = [p for p in picks if p is not None]
                    cov.stopped_walkers += len(picks) - len(real)
                    cov.merged_walkers += len(real) - len(set(real))
            if tie_at_boundary(rr.stm_ranking, rr.scores, cfg.num_stm_reminded) or tie_at_boundary(
                rr.ltm_ranking, rr.scores, cfg.num_ltm_reminded
            ):
                cov.score_ties += 1

        # ---- weights: per position of reminded_slots; garbage at padding
        R = r.reminded_slots.shape[1]
        wt = torch.zeros(batch, R)
        row_weights = []
        for b, rr in enumerate(rrs):
            for attempt in range(100):
                draw = {"dyadic": dyadic_weights, "coarse": coarse_weights, "float": float_weights}[weights]
                vals = draw(rng, len(rr.reminded))
                wmap = dict(zip(rr.reminded, vals))
                if weights != "float" or _lifespans_sharp(refs[b], rr, wmap):
                    break
                cov.redraw_weights += 1
            else:
                raise AssertionError("could not draw weights keeping lifespans away from 0")
            if sum(max(v, 0.0) for v in vals) == 0 and vals:
                cov.equal_shares += 1
            rem_uids = slots_to_uids(state, b, r.reminded_slots[b].tolist())
            for p, u in enumerate(rem_uids):
                wt[b, p] = wmap[u] if u >= 0 else rng.choice(GARBAGE)
            row_weights.append(wmap)

        # ---- memorize
        stats = memorize(state, r, wt, cfg)
        for b, rr in enumerate(rrs):
            w = where(b)
            reminded_before = set(rr.reminded)
            rs = refs[b].memorize(rr, row_weights[b])
            cov.deaths_of_reminded += len(reminded_before - set(refs[b].engrams))
            compare_row(state, refs[b], b, w, cov)
            compare_stats(stats, rs, b, w)
        cov.steps += 1
    return cov


def _eviction_tie(ref) -> int:
    """1 if this step's eviction must choose between LTM engrams of equal lifespan."""
    need = len(ref.engrams) + ref.config.num_wm - ref.config.capacity
    if need <= 0:
        return 0
    lives = sorted(e.lifespan for e in ref.engrams.values() if e.kind == ref_mod.LTM)
    return int(need < len(lives) and lives[need - 1] == lives[need])


def _lifespans_sharp(ref, rr, wmap) -> bool:
    """Continuous weights: no engram may end the step within SCORE_GAP of 0 (float32 vs float64)."""
    inc = ref.increments(rr.reminded, wmap)
    for u, e in ref.engrams.items():
        after = e.lifespan + inc.get(u, 0.0) - 1.0
        if after != 0.0 and abs(after) < SCORE_GAP:
            return False
    return True


def compare_row(state: MemoryState, ref, b: int, w: str, cov: Coverage) -> None:
    eng = engine_row(state, b)
    cov.max_alive = max(cov.max_alive, len(eng))
    ref_kinds = {u: KIND_CODES[k] for u, k in ref.kinds().items()}
    eng_kinds = {u: v[1] for u, v in eng.items()}
    if eng_kinds != ref_kinds:
        diff = {u: (eng_kinds.get(u), ref_kinds.get(u)) for u in set(eng_kinds) | set(ref_kinds)
                if eng_kinds.get(u) != ref_kinds.get(u)}
        raise AssertionError(f"{w} alive engrams after memorize differ, uid: (engine kind, reference kind): {diff}; "
                             f"reference lifespans of those: { {u: ref.engrams[u].lifespan for u in diff if u in ref.engrams} }")
    for u, (slot, _, life) in eng.items():
        ref_life = ref.engrams[u].lifespan
        cov.max_life_err = max(cov.max_life_err, abs(life - ref_life))
        assert lifespan_close(life, ref_life), f"{w} lifespan of uid {u}: engine {life}, reference {ref_life}"
        assert state.vectors[b, slot].tolist() == list(ref.engrams[u].vector), f"{w} vector of uid {u}"
    uids = sorted(eng)
    if uids:
        slots = torch.tensor([eng[u][0] for u in uids])
        got = state.counts[b].index_select(0, slots).index_select(1, slots).long()
        pos = {u: n for n, u in enumerate(uids)}
        entries = [(pos[i], pos[j], c) for i, row in ref.counts.items() for j, c in row.items()]
        want = torch.zeros(len(uids), len(uids), dtype=torch.long)
        if entries:
            rows, cols, vals = zip(*entries)
            want[list(rows), list(cols)] = torch.tensor(vals, dtype=torch.long)
        if not torch.equal(got, want):
            bad = (got != want).nonzero().tolist()[:5]
            raise AssertionError(
                f"{w} counts among live engrams differ at (uid_i, uid_j): engine vs reference "
                + ", ".join(f"({uids[i]},{uids[j]}): {int(got[i, j])} vs {int(want[i, j])}" for i, j in bad)
            )
    assert int(state.step[b]) == ref.step, f"{w} step counter"
    assert int(state.evictions[b]) == ref.evictions, f"{w} eviction counter"


def _same(a: float, b: float, tol: float) -> bool:
    if math.isnan(b):
        return math.isnan(a)
    return abs(a - b) <= tol


def compare_stats(stats, rs, b: int, w: str) -> None:
    got = stats.engrams[b].tolist()
    want = [rs.engrams["empty"], rs.engrams["wm"], rs.engrams["stm"], rs.engrams["ltm"]]
    assert got == want, f"{w} stats.engrams (empty, wm, stm, ltm): engine {got}, reference {want}"
    for name in ("evicted", "reminded_stm", "reminded_ltm", "found_ltm"):
        assert int(getattr(stats, name)[b]) == getattr(rs, name), (
            f"{w} stats.{name}: engine {int(getattr(stats, name)[b])}, reference {getattr(rs, name)}"
        )
    for name, tol in (("reminded_ltm_age", 1e-4), ("lifespan_mean", 1e-4), ("lifespan_max", LIFE_TOL)):
        g, e = float(getattr(stats, name)[b]), getattr(rs, name)
        assert _same(g, e, tol * max(1.0, abs(e) if not math.isnan(e) else 1.0)), (
            f"{w} stats.{name}: engine {g}, reference {e}"
        )


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: thread hand-offs would cost more than the work on a shared 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- configurations
CONFIGS = {
    # LM ratios of the paper (N_wm = K_stm = K_ltm, C_stm = 8 N_wm, L0 = 9, alpha = 8, depth 10)
    "paper_lm_small": dict(cfg=dict(num_wm=2, num_stm_reminded=2, num_ltm_reminded=2, stm_capacity=16,
                                    initial_lifespan=9.0, alpha=8.0, search_depth=10)),
    # sorting-task ratios (Appendix B.1) for a 16-token segment
    "paper_sort_small": dict(cfg=dict(segment_length=16)),
    # odd C_stm: siblings of one step are split between STM (cue) and LTM, which gives
    # the search its first edges while no STM engram is ever reminded
    "no_stm": dict(cfg=dict(num_wm=2, num_stm_reminded=3, num_ltm_reminded=4, stm_capacity=5,
                            initial_lifespan=6.0, alpha=4.0, search_depth=2, use_stm=False)),
    "no_ltm": dict(cfg=dict(num_wm=2, num_stm_reminded=3, num_ltm_reminded=4, stm_capacity=6,
                            initial_lifespan=4.0, alpha=4.0, search_depth=2, use_ltm=False)),
    "no_stm_no_ltm": dict(cfg=dict(num_wm=2, num_stm_reminded=3, num_ltm_reminded=4, stm_capacity=6,
                                   initial_lifespan=4.0, alpha=4.0, search_depth=2, use_stm=False, use_ltm=False)),
    "exhaustive": dict(cfg=dict(num_wm=2, num_stm_reminded=3, num_ltm_reminded=5, stm_capacity=6,
                                initial_lifespan=4.0, alpha=4.0, search_depth=2, search="exhaustive")),
    "exhaustive_no_stm": dict(cfg=dict(num_wm=2, num_stm_reminded=3, num_ltm_reminded=5, stm_capacity=6,
                                       initial_lifespan=5.0, alpha=4.0, search_depth=2, search="exhaustive",
                                       use_stm=False)),
    # capacity 300 and ~150 engrams alive: exhaustive scoring spans several candidate chunks
    "exhaustive_many": dict(cfg=dict(num_wm=2, num_stm_reminded=3, num_ltm_reminded=6, stm_capacity=8,
                                     initial_lifespan=70.0, alpha=2.0, search_depth=2, search="exhaustive",
                                     capacity=300), reset_p=(0.0, 0.0, 0.01)),
    # capacity 20 where ~40 engrams would live: the row fills up and LTM engrams are evicted;
    # coarse weights (often equal) give many equal lifespans, so the uid tie rule decides
    "evicting": dict(cfg=dict(num_wm=2, num_stm_reminded=3, num_ltm_reminded=4, stm_capacity=5,
                              initial_lifespan=8.0, alpha=2.0, search_depth=3, capacity=20), weights="coarse"),
    # depth 0: entry points only; K_ltm > K_stm so padding with real engrams found
    "depth0": dict(cfg=dict(num_wm=2, num_stm_reminded=3, num_ltm_reminded=5, stm_capacity=6,
                            initial_lifespan=5.0, alpha=4.0, search_depth=0, count_dtype="int32")),
    # K_ltm larger than the K_stm * (depth + 1) engrams the search can ever find
    "k_ltm_beyond_search": dict(cfg=dict(num_wm=2, num_stm_reminded=2, num_ltm_reminded=8, stm_capacity=6,
                                         initial_lifespan=5.0, alpha=4.0, search_depth=1)),
    # no cues at all (K_stm = 0): only the exhaustive search reaches LTM
    "no_cues_exhaustive": dict(cfg=dict(num_wm=2, num_stm_reminded=0, num_ltm_reminded=3, stm_capacity=4,
                                        initial_lifespan=6.0, alpha=4.0, search_depth=2, search="exhaustive")),
    # one WM engram per step: scores are -d^2, integers, many exact ties
    "single_wm_trits": dict(cfg=dict(num_wm=1, num_stm_reminded=3, num_ltm_reminded=4, stm_capacity=5,
                                     initial_lifespan=4.0, alpha=3.0, search_depth=3), dim=3, data="trits"),
    # continuous vectors, N_wm = 4, float weights (re-drawn when a decision is within 1e-4)
    "continuous": dict(cfg=dict(num_wm=4, num_stm_reminded=4, num_ltm_reminded=6, stm_capacity=12,
                                initial_lifespan=4.0, alpha=1.5, search_depth=3), dim=8, data="normal",
                       weights="float"),
    # continuous vectors drawn from a small pool: copies of one vector sit in several STM/LTM
    # slots (and several columns of the scoring matmul); the newest copy must win (issue 17 item 9)
    "continuous_repeats": dict(cfg=dict(num_wm=5, num_stm_reminded=3, num_ltm_reminded=4, stm_capacity=10,
                                        initial_lifespan=4.0, alpha=1.5, search_depth=2), dim=16,
                               data="normal_repeats", weights="float"),
}


def make_config(spec: dict) -> MemoriaConfig:
    values = dict(spec)
    if "segment_length" in values:
        return MemoriaConfig.for_segment_length(values.pop("segment_length"), **values)
    return MemoriaConfig(**values)


_NAMES: dict[int, str] = {}


def cfg_name(cfg: MemoriaConfig) -> str:
    return _NAMES.get(id(cfg), "config")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_matches_reference(name):
    spec = CONFIGS[name]
    cfg = make_config(spec["cfg"])
    _NAMES[id(cfg)] = name
    kwargs = {k: v for k, v in spec.items() if k != "cfg"}
    cov = run_equivalence(cfg, steps=200, **kwargs)

    # the run exercised what it is meant to
    assert cov.steps == 200 and cov.resets > 0, "rows were reset during the run"
    if cfg.use_stm and cfg.num_stm_reminded > 0:
        assert cov.stm_reminded > 0
    if cfg.use_ltm:
        assert cov.ltm_reminded > 0, f"{name}: no LTM engram was ever reminded"
    else:
        assert cov.ltm_reminded == 0
    if name == "evicting":
        assert cov.evictions > 0, "the small capacity must force evictions"
        assert cov.eviction_ties > 0, "some eviction must be decided by the uid tie rule"
    else:
        assert cov.evictions == 0 or cfg.capacity < 64
    if name in ("paper_lm_small", "paper_sort_small", "evicting", "single_wm_trits", "continuous"):
        assert cov.deep_picks > 0, f"{name}: the depth search never went past the entry points"
        assert cov.merged_walkers > 0, f"{name}: no two walkers ever landed on one engram"
        assert cov.stopped_walkers > 0, f"{name}: no walker ever ran out of edges"
    if name in ("depth0", "k_ltm_beyond_search"):
        assert cov.ltm_padding_with_found > 0, f"{name}: K_ltm never exceeded what was found"
    if name in ("paper_lm_small", "paper_sort_small", "single_wm_trits", "exhaustive", "continuous_repeats"):
        assert cov.score_ties > 0, f"{name}: no selection was decided by the uid tie rule"
    if name == "exhaustive_many":
        assert cov.max_alive > 128, "exhaustive scoring must span more than one 128-candidate chunk"
    if not name.startswith("continuous"):
        assert cov.redraw_wm == 0 and cov.max_life_err == 0.0, "integer data must be exact"
    else:
        assert cov.evictions == 0, "continuous lifespans are not compared for eviction order"


@pytest.mark.parametrize("name", ["paper_lm_small", "evicting", "exhaustive_many", "single_wm_trits",
                                  "continuous_repeats"])
def test_the_fewer_operations_layout_matches_reference(name, monkeypatch):
    """The step as a GPU runs it (`state.CACHE_TUNED_DEVICES` does not name its device: the digest
    in one product, all candidates scored in one matmul, edge keys int64 from one mixed-dtype add),
    run here on the CPU against the same reference."""
    from memoria_ds.memory import state

    monkeypatch.setattr(state, "CACHE_TUNED_DEVICES", ())
    spec = CONFIGS[name]
    cfg = make_config(spec["cfg"])
    _NAMES[id(cfg)] = name
    cov = run_equivalence(cfg, steps=200, **{k: v for k, v in spec.items() if k != "cfg"})
    assert cov.steps == 200 and cov.ltm_reminded > 0
