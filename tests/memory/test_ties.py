"""Exact ties between bit-identical engrams: the newer one wins (issue 17 item 9)."""

from __future__ import annotations

import pytest
import torch

from memoria_ds.memory import MemoriaConfig, MemoryState, memorize, remind
from memoria_ds.memory.retrieve import _Rows
from memoria_ds.memory.state import _MULTIPLIERS, vector_digest


def _step(state, cfg, wm):
    r = remind(state, torch.tensor(wm, dtype=torch.float32)[None], cfg)
    memorize(state, r, torch.ones_like(r.reminded_slots, dtype=torch.float32), cfg)
    return r


def test_the_issue_case_reminds_the_newest_copies():
    """The reproduction of issue 17 item 9, verbatim: three copies of `a` written in one step
    (uids (2,0), (2,2), (2,3)); the two newest must be reminded."""
    cfg = MemoriaConfig(num_wm=5, num_stm_reminded=3, num_ltm_reminded=3, stm_capacity=5, initial_lifespan=4.5,
                        search_depth=2)
    state = MemoryState.empty(cfg, 1, 2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        _step(state, cfg, torch.randn(5, 2, generator=gen).tolist())
    a, b, c = (0.0443422757089138, -0.6744216680526733), (1.2551898956298828, -0.0765715017914772), \
        (0.406521737575531, -0.6140572428703308)
    _step(state, cfg, [a, b, a, a, c])
    w0, w1, w4 = (-0.9784577488899231, 0.9650402069091797), (0.009302838705480099, -0.028760699555277824), \
        (0.6509770750999451, -0.4399017095565796)
    r = _step(state, cfg, [w0, w1, w1, w1, w4])
    uids = [divmod(int(state.uid[0, s]), cfg.num_wm) for s in r.stm_slots[0].tolist()]
    assert sorted(uids) == [(2, 2), (2, 3), (2, 4)], uids


def test_share_identical_merges_exact_copies_only():
    cfg = MemoriaConfig(num_wm=2, num_stm_reminded=2, num_ltm_reminded=2, stm_capacity=4, search_depth=1)
    state = MemoryState.empty(cfg, 2, 3)
    v = torch.tensor([[0.5, -1.0, 2.0], [0.5, -1.0, 2.0], [-0.5, 1.0, 2.0], [0.5, -1.0, 2.0000002], [0.0, 0.0, 0.0]])
    state.vectors[:, :5] = v
    state.vectors[1, 6] = v[0]
    state.sq_norms.copy_(state.vectors.square().sum(-1))
    state.digest.copy_(vector_digest(state.vectors))
    rows = _Rows(state)
    slots = torch.tensor([[0, 1, 2, 3, 4, -1], [6, 3, -1, 0, 1, 2]])
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, float("-inf")], [7.0, 6.0, float("-inf"), 1.0, 8.0, 0.5]])
    flat = rows.flat(slots)
    shared = rows.share_identical(slots, flat, rows.sq_norms.index_select(0, flat).view(2, 6), scores.clone())
    # row 0: slots 0 and 1 are copies (-> 2.0 both); 2 has the same norm but other values, 3
    # differs in the last bit, 4 is zero, the padding stays -inf (it reads slot 0 but is not merged)
    assert shared[0].tolist() == [2.0, 2.0, 3.0, 4.0, 5.0, float("-inf")]
    # row 1: slot 6 holds a third copy, in another column: all three share the largest score
    assert shared[1].tolist() == [8.0, 6.0, float("-inf"), 8.0, 8.0, 0.5]


def test_vector_digest_is_exact_and_order_free():
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(6, 40, generator=gen)
    d = vector_digest(v)
    assert d.dtype == torch.int64 and d.shape == (6,)
    assert torch.equal(vector_digest(v.clone()[[2, 0]]), d[[2, 0]])  # bits, not position, decide
    assert torch.equal(vector_digest(v[:, None].expand(6, 3, 40)), d[:, None].expand(6, 3))
    assert len(set(d.tolist())) == 6
    w = v.clone()
    w[0, 17] = torch.nextafter(w[0, 17], torch.tensor(float("inf")))  # one bit of one coordinate
    w[1, 5] = -w[1, 5]  # a sign
    w[2, 0], w[2, 1] = v[2, 1], v[2, 0]  # two coordinates swapped
    assert (vector_digest(w)[:3] != d[:3]).all() and torch.equal(vector_digest(w)[3:], d[3:])
    # by hand: 1.0 = 0x3F800000 -> little-endian int16 halves 0x0000, 0x3F80 times the fixed multipliers
    got = vector_digest(torch.tensor([[0.0, 1.0], [-2.0, 0.0]]))
    m = _MULTIPLIERS[(2, "cpu")].long()
    # -2.0 = 0xC0000000 -> halves 0x0000 and 0xC000 = -16384 as a signed int16
    assert got.tolist() == [0x3F80 * int(m[3]), -16384 * int(m[1])]
    # the largest width: the sum stays exact (the result is the same in exact integer arithmetic)
    big = torch.randn(2, (1 << 15) - 1, generator=gen)
    got = vector_digest(big)
    m = _MULTIPLIERS[((1 << 15) - 1, "cpu")].long().tolist()
    assert got.tolist() == [sum(h * k for h, k in zip(row.view(torch.int16).tolist(), m)) for row in big]


@pytest.mark.parametrize("layout", ["cache-tuned", "few-ops", "few-ops-past-the-copy-bound"])
def test_the_blocked_digest_is_the_whole_product(monkeypatch, layout):
    """`vector_digest` sums its product block by block (`_DIGEST_BLOCK` halves at a time) on a CPU,
    and off it when the float64 copy would pass `_DIGEST_COPY_BYTES`; otherwise in one product: the
    same digests as one (..., 2D) float64 product every way, also with a partial last block and at
    the working memory's shape."""
    from memoria_ds.memory import state as state_module
    from memoria_ds.memory.state import _DIGEST_BLOCK, digest_multipliers

    if layout != "cache-tuned":  # the layout a GPU takes, on this CPU
        monkeypatch.setattr(state_module, "CACHE_TUNED_DEVICES", ())
    if layout == "few-ops-past-the-copy-bound":
        monkeypatch.setattr(state_module, "_DIGEST_COPY_BYTES", 0)
    gen = torch.Generator().manual_seed(5)
    for shape in [(4, 50, 768), (3, 700), (2, _DIGEST_BLOCK // 2), (5, 1, 1)]:
        v = torch.randn(*shape, generator=gen) * 1e3
        whole = (v.view(torch.int16).to(torch.float64) @ digest_multipliers(shape[-1], "cpu")).to(torch.int64)
        assert torch.equal(vector_digest(v), whole), shape
    assert 2 * 768 > 5 * _DIGEST_BLOCK  # the paper's width spans several blocks


def test_off_the_cpu_a_step_digests_its_working_memory_in_one_product(monkeypatch):
    """At the paper's settings (B = 8, N_wm = 50, D = 768) a step's digest is 7 operations (3 of
    them kernels) off the CPU, where a GPU launches each; on a CPU its blocks take 44 (18) and keep
    the float64 copy to a block (the engine's peak memory); a whole state's copy (B = 4, C = 1664:
    82 MB) is made by blocks everywhere."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memoria_ds.memory import state as state_module

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    wm = torch.randn(8, 50, 768)
    digest = vector_digest(wm)  # the multipliers are made once per width, outside the counts
    with Count() as on_cpu:
        vector_digest(wm)
    monkeypatch.setattr(state_module, "CACHE_TUNED_DEVICES", ())
    with Count() as off_cpu:
        off = vector_digest(wm)
    assert torch.equal(off, digest)
    assert off_cpu.n <= 7 < 40 <= on_cpu.n
    assert 4 * 1664 * 2 * 768 * 8 > state_module._DIGEST_COPY_BYTES >= wm.numel() * 2 * 8


def test_a_state_saved_without_digests_loads_with_them():
    cfg = MemoriaConfig(num_wm=2, num_stm_reminded=2, num_ltm_reminded=2, stm_capacity=4, search_depth=1)
    state = MemoryState.empty(cfg, 2, 3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        r = remind(state, torch.randn(2, 2, 3, generator=gen), cfg)
        memorize(state, r, torch.ones_like(r.reminded_slots, dtype=torch.float32), cfg)
    old = {k: v for k, v in state.state_dict().items() if k != "digest"}
    loaded = MemoryState.from_state_dict(old, cfg)
    live = state.uid >= 0
    assert torch.equal(loaded.digest[live], state.digest[live])
