"""MemoryState as an object: serialisation, moving rows, resets, determinism, devices.

Rows are compared through uids (which engram is alive, of which kind, with which lifespan,
which engrams were reminded, the counts among live engrams), never through slot
positions, except where bit-identical tensors are the claim (serialisation, determinism).
"""

from __future__ import annotations

import io

import pytest
import torch

from memoria_ds.memory import EMPTY, MemoriaConfig, MemoryState, memorize, remind

CFG = MemoriaConfig(num_wm=2, num_stm_reminded=3, num_ltm_reminded=4, stm_capacity=6, initial_lifespan=4.0,
                    alpha=3.0, search_depth=3, capacity=40)
DIM = 5


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- a stream of inputs
def stream_wm(stream: int, t: int, cfg: MemoriaConfig = CFG, dim: int = DIM) -> torch.Tensor:
    """The WM of stream `stream` at its t-th step: integer vectors in {0, 1} (exact distances)."""
    gen = torch.Generator().manual_seed(1_000_003 * stream + t)
    return torch.randint(0, 2, (cfg.num_wm, dim), generator=gen).float()


def weight_of(stream: int, uid: int) -> float:
    """A deterministic weight for an engram of a stream (dyadic: exact in float32)."""
    return float((uid * 7 + stream * 3) % 5) / 4.0


def weights_for(state: MemoryState, r, streams: list[int]) -> torch.Tensor:
    w = torch.full(r.reminded_slots.shape, 0.5)
    for b, stream in enumerate(streams):
        for p, s in enumerate(r.reminded_slots[b].tolist()):
            if s >= 0:
                w[b, p] = weight_of(stream, int(state.uid[b, s]))
    return w


def step(state: MemoryState, streams: list[int], ts: list[int], cfg: MemoriaConfig = CFG):
    """One memory step of rows fed by `streams` at their steps `ts`. Returns (reminded uids, stats)."""
    wm = torch.stack([stream_wm(s, t, cfg, state.dim) for s, t in zip(streams, ts)])
    r = remind(state, wm, cfg)
    reminded = [[int(state.uid[b, s]) if s >= 0 else -1 for s in r.reminded_slots[b].tolist()]
                for b in range(state.batch_size)]
    stats = memorize(state, r, weights_for(state, r, streams).to(state.device), cfg)
    return reminded, stats


def row_view(state: MemoryState, b: int) -> dict:
    """Everything about row b that has meaning, keyed by uid."""
    alive = (state.kind[b] != EMPTY).nonzero().squeeze(1)
    uids = state.uid[b, alive].tolist()
    order = sorted(range(len(uids)), key=lambda i: uids[i])
    slots = alive[order]
    return {
        "uids": [uids[i] for i in order],
        "kind": state.kind[b, slots].tolist(),
        "lifespan": state.lifespan[b, slots].tolist(),
        "vectors": state.vectors[b, slots].tolist(),
        "counts": state.counts[b].index_select(0, slots).index_select(1, slots).tolist(),
        "step": int(state.step[b]),
        "evictions": int(state.evictions[b]),
    }


def assert_rows_equal(a: MemoryState, ra: int, b: MemoryState, rb: int, what: str) -> None:
    va, vb = row_view(a, ra), row_view(b, rb)
    for key in va:
        assert va[key] == vb[key], f"{what}: `{key}` differs"


def run(state: MemoryState, streams: list[int], start: int, steps: int) -> list:
    out = []
    for t in range(start, start + steps):
        out.append(step(state, streams, [t] * len(streams))[0])
    return out


# --------------------------------------------------------------------------- serialisation
def _filled(batch: int = 3, steps: int = 25) -> MemoryState:
    state = MemoryState.empty(CFG, batch, DIM)
    run(state, list(range(batch)), 0, steps)
    return state


def test_state_dict_round_trip_is_bit_exact():
    state = _filled()
    sd = state.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    for restored in (MemoryState.from_state_dict(sd, CFG), MemoryState.from_state_dict(loaded, CFG)):
        for name, t in state.tensors().items():
            u = getattr(restored, name)
            assert u.dtype == t.dtype and torch.equal(u, t), f"field `{name}` changed in the round trip"
    target = MemoryState.empty(CFG, 3, DIM)
    target.load_state_dict(loaded)
    for name, t in state.tensors().items():
        assert torch.equal(getattr(target, name), t), f"load_state_dict: field `{name}`"
    # and both continue exactly like the original
    a, b = state.clone(), target
    ra = run(a, [0, 1, 2], 25, 10)
    rb = run(b, [0, 1, 2], 25, 10)
    assert ra == rb
    for name, t in a.tensors().items():
        assert torch.equal(getattr(b, name), t), f"after 10 more steps: field `{name}`"


def test_state_dict_is_a_copy_safe_snapshot():
    state = _filled(steps=5)
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.state_dict().items()}
    snapshot = MemoryState.from_state_dict(saved, CFG)
    run(state, [0, 1, 2], 5, 3)
    assert not torch.equal(snapshot.step, state.step), "the snapshot must not follow the live state"


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda sd: sd.pop("counts"), r"missing.*counts"),
        (lambda sd: sd.pop("format"), r"format"),
        (lambda sd: sd.__setitem__("format", 99), r"format 99"),
        (lambda sd: sd.__setitem__("lifespan", [0.0]), r"lifespan.*tensor"),
        (lambda sd: sd.__setitem__("kind", sd["kind"].to(torch.int64)), r"kind.*dtype"),
        (lambda sd: sd.__setitem__("counts", sd["counts"].to(torch.int32)), r"counts.*dtype"),
        (lambda sd: sd.__setitem__("uid", sd["uid"][:, :-1]), r"uid.*shape"),
    ],
)
def test_corrupted_state_dict_is_a_clear_error(corrupt, match):
    sd = dict(_filled(steps=3).state_dict())
    corrupt(sd)
    with pytest.raises(ValueError, match=match):
        MemoryState.from_state_dict(sd, CFG)


def test_state_dict_for_another_config_is_a_clear_error():
    sd = _filled(steps=3).state_dict()
    other = MemoriaConfig(**{**CFG.to_dict(), "capacity": 48})
    with pytest.raises(ValueError, match=r"capacity 40.*48"):
        MemoryState.from_state_dict(sd, other)
    with pytest.raises(ValueError, match=r"saved \(3, 40, 5\).*\(3, 48, 5\)"):
        MemoryState.empty(other, 3, DIM).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"missing"):
        MemoryState.empty(CFG, 3, DIM).load_state_dict({"format": sd["format"], "vectors": sd["vectors"]})


# --------------------------------------------------------------------------- moving rows
def test_take_put_cat_rows_continue_like_never_moved():
    streams = [0, 1, 2, 3]
    ref = MemoryState.empty(CFG, 4, DIM)
    run(ref, streams, 0, 30)
    moved = ref.clone()

    # split rows {0, 2} and {1, 3} into two states; run them apart; stitch them back
    left, right = moved.take_rows([0, 2]), moved.take_rows(torch.tensor([1, 3]))
    ra = run(ref, streams, 30, 15)
    rl = run(left, [0, 2], 30, 15)
    rr = run(right, [1, 3], 30, 15)
    for t in range(15):
        assert ra[t] == [rl[t][0], rr[t][0], rl[t][1], rr[t][1]], f"step {30 + t}: reminded uids"
    joined = MemoryState.cat([left, right])  # rows in order 0, 2, 1, 3
    for b, src in enumerate([0, 2, 1, 3]):
        assert_rows_equal(joined, b, ref, src, f"cat row {b} vs original row {src}")

    # put the rows back into a state in their original order, continue both
    back = MemoryState.empty(CFG, 4, DIM)
    back.put_rows([0, 2], left)
    back.put_rows(torch.tensor([1, 3]), right)
    ra = run(ref, streams, 45, 15)
    rb = run(back, streams, 45, 15)
    assert ra == rb
    for b in range(4):
        assert_rows_equal(back, b, ref, b, f"row {b} after put_rows and 15 more steps")


def test_put_rows_checks_shapes():
    state = MemoryState.empty(CFG, 3, DIM)
    with pytest.raises(ValueError, match="row indices"):
        state.put_rows([0, 1], MemoryState.empty(CFG, 3, DIM))
    with pytest.raises(ValueError, match="cannot put rows of `vectors`"):
        state.put_rows([0], MemoryState.empty(CFG, 1, DIM + 1))
    with pytest.raises(ValueError, match="at least one"):
        MemoryState.cat([])


def test_taken_rows_are_copies():
    state = _filled(steps=10)
    part = state.take_rows([1])
    before = row_view(state, 1)
    run(part, [1], 10, 5)
    assert row_view(state, 1) == before, "running the taken rows must not touch the source"


# --------------------------------------------------------------------------- reset
@pytest.mark.parametrize("when", [1, 12, 40])
def test_reset_rows_behave_exactly_like_a_fresh_memory(when):
    streams = [0, 1, 2]
    state = MemoryState.empty(CFG, 3, DIM)
    untouched = MemoryState.empty(CFG, 3, DIM)
    run(state, streams, 0, when)
    run(untouched, streams, 0, when)

    state.reset(torch.tensor([True, False, True]))
    fresh = MemoryState.empty(CFG, 2, DIM)  # rows 0 and 2 start over: streams 10 and 12 from their step 0
    for t in range(60):
        got, gstats = step(state, [10, 1, 12], [t, when + t, t])
        want, _ = step(fresh, [10, 12], [t, t])
        keep, _ = step(untouched, streams[:1] + [1] + streams[2:], [when + t] * 3)
        assert [got[0], got[2]] == want, f"{t} steps after the reset: reminded uids of the reset rows"
        assert got[1] == keep[1], f"{t} steps after the reset: the row that was not reset"
        assert_rows_equal(state, 0, fresh, 0, f"reset row 0, {t + 1} steps after")
        assert_rows_equal(state, 2, fresh, 1, f"reset row 2, {t + 1} steps after")
        assert_rows_equal(state, 1, untouched, 1, f"row 1 (not reset), {t + 1} steps after")
        assert int(gstats.evicted[0]) == 0


def test_reset_all_rows_and_mask_validation():
    state = _filled()
    state.reset()
    fresh = MemoryState.empty(CFG, 3, DIM)
    assert run(state, [5, 6, 7], 0, 20) == run(fresh, [5, 6, 7], 0, 20)
    for b in range(3):
        assert_rows_equal(state, b, fresh, b, f"row {b} after reset()")
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        state.reset(torch.tensor([True, False]))


def test_reset_with_a_small_capacity_clears_evictions():
    cfg = MemoriaConfig(num_wm=2, num_stm_reminded=3, num_ltm_reminded=4, stm_capacity=4, initial_lifespan=8.0,
                        alpha=4.0, search_depth=3, capacity=12)
    state = MemoryState.empty(cfg, 2, DIM)
    for t in range(30):
        step(state, [0, 1], [t, t], cfg)
    assert (state.evictions > 0).all(), "this capacity must evict"
    state.reset(torch.tensor([False, True]))
    assert int(state.evictions[1]) == 0 and int(state.evictions[0]) > 0
    fresh = MemoryState.empty(cfg, 1, DIM)
    for t in range(30):
        step(state, [0, 9], [30 + t, t], cfg)
        step(fresh, [9], [t], cfg)
        assert_rows_equal(state, 1, fresh, 0, f"reset row, {t + 1} steps after")


# --------------------------------------------------------------------------- determinism
def test_two_runs_are_bit_identical_and_the_global_rng_is_untouched():
    def once():
        state = MemoryState.empty(CFG, 3, DIM)
        gen = torch.Generator().manual_seed(7)
        history = []
        for t in range(40):
            wm = torch.randint(0, 2, (3, CFG.num_wm, DIM), generator=gen).float()
            rng = torch.random.get_rng_state()
            r = remind(state, wm, CFG)
            stats = memorize(state, r, torch.rand(r.reminded_slots.shape, generator=gen), CFG)
            assert torch.equal(torch.random.get_rng_state(), rng), "a memory step consumed the global RNG"
            history.append((r.reminded_slots.clone(), stats.lifespan_mean.clone()))
        return state, history

    a, ha = once()
    b, hb = once()
    for name, t in a.tensors().items():
        assert torch.equal(getattr(b, name), t), f"field `{name}` differs between two identical runs"
    for (sa, la), (sb, lb) in zip(ha, hb):
        assert torch.equal(sa, sb), "reminded slots differ between two identical runs"
        torch.testing.assert_close(la, lb, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------- batch sizes
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_any_batch_size_gives_the_same_rows(batch):
    # row b of a batch of any size behaves like row b of a batch of 5
    big = MemoryState.empty(CFG, 5, DIM)
    small = MemoryState.empty(CFG, batch, DIM)
    for t in range(30):
        rb, _ = step(big, [0, 1, 2, 3, 4], [t] * 5)
        rs, _ = step(small, list(range(batch)), [t] * batch)
        assert rs == rb[:batch], f"step {t}"
    for b in range(batch):
        assert_rows_equal(small, b, big, b, f"row {b} in a batch of {batch}")


def test_batch_of_one_with_and_without_reset():
    state = MemoryState.empty(CFG, 1, DIM)
    run(state, [3], 0, 10)
    state.reset(torch.tensor([True]))
    fresh = MemoryState.empty(CFG, 1, DIM)
    assert run(state, [4], 0, 10) == run(fresh, [4], 0, 10)


# --------------------------------------------------------------------------- devices
@pytest.mark.gpu
def test_cuda_round_trip_and_same_results_on_gpu():
    state = _filled()
    on_gpu = state.to("cuda")
    assert on_gpu.device.type == "cuda"
    back = on_gpu.to("cpu")
    for name, t in state.tensors().items():
        assert getattr(on_gpu, name).dtype == t.dtype, f"`{name}` changed dtype on the way to the GPU"
        assert torch.equal(getattr(back, name), t), f"`{name}` changed in the round trip"
    # integer data: the GPU must remind exactly what the CPU reminds
    cpu_hist = run(state, [0, 1, 2], 25, 20)
    gpu_hist = run(on_gpu, [0, 1, 2], 25, 20)
    assert cpu_hist == gpu_hist
    for b in range(3):
        assert_rows_equal(on_gpu.to("cpu"), b, state, b, f"row {b} after 20 steps on the GPU")


def test_memory_stats_copy_owns_its_tensors():
    # the training loop keeps a step's statistics past later replays of a CUDA-graph step (whose
    # outputs the next replay overwrites): the copy equals and shares no storage
    from dataclasses import fields

    from memoria_ds.memory.stats import MemoryStats

    stats = MemoryStats(**{f.name: torch.arange(8.0).reshape(2, 4) + i for i, f in enumerate(fields(MemoryStats))})
    copy = stats.copy()
    for f in fields(MemoryStats):
        a, b = getattr(stats, f.name), getattr(copy, f.name)
        assert torch.equal(a, b) and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), f.name
    assert copy.summary() == stats.summary()
