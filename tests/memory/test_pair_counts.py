"""The co-retrieval counts of a step (SPEC step 9a) and how they are added.

`_add_pair_counts` is checked against a plain loop, with padding beside an active slot 0
(padding is clamped to slot 0, the case that could double-count) and at saturation. And
the whole memory step adds into no integer tensor by accumulation: on a GPU an
accumulating scatter compiles to atomic adds, and Triton has none for int16 (the
H200 check of 2026-11-26 failed to compile the engine on exactly that).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memoria_ds.memory import MemoriaConfig, MemoryState, memorize, remind
from memoria_ds.memory.memorize import _add_pair_counts


def reference(counts: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """counts[b, i, j] += 1 for each ordered pair of real slots, unless row i is saturated."""
    out = counts.clone()
    top = torch.iinfo(counts.dtype).max
    for b in range(active.shape[0]):
        slots = [int(s) for s in active[b] if s >= 0]
        for i in slots:
            if counts[b, i, i] >= top:
                continue
            for j in slots:
                out[b, i, j] += 1
    return out


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32])
def test_pair_counts_match_a_loop_with_padding_beside_slot_zero(dtype):
    gen = torch.Generator().manual_seed(0)
    C = 9
    counts = torch.randint(0, 50, (4, C, C), generator=gen, dtype=torch.int64).to(dtype)
    active = torch.tensor([
        [0, 3, -1, 5, -1],   # slot 0 active, padding beside it
        [-1, 2, 7, -1, 1],   # slot 0 not active, padding clamps onto it
        [-1, -1, -1, -1, -1],  # nothing active
        [8, 0, 4, 6, 2],     # no padding
    ])
    expected = reference(counts, active)
    _add_pair_counts(counts, active)
    assert torch.equal(counts, expected)


def test_a_saturated_row_keeps_its_counts():
    counts = torch.zeros(1, 4, 4, dtype=torch.int16)
    counts[0, 1, 1] = torch.iinfo(torch.int16).max
    counts[0, 1, 2] = 7
    active = torch.tensor([[1, 2, 0, -1]])
    expected = reference(counts, active)
    _add_pair_counts(counts, active)
    assert torch.equal(counts, expected)
    assert int(counts[0, 1, 2]) == 7 and int(counts[0, 2, 1]) == 1 and int(counts[0, 0, 0]) == 1


class _IntegerAccumulation(TorchDispatchMode):
    """Records every accumulating scatter into an integer tensor."""

    ACCUMULATING = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                    "index_reduce", "index_reduce_"}

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        accumulate = name in self.ACCUMULATING or (
            name in {"index_put", "index_put_", "_index_put_impl_", "put", "put_"}
            and (kwargs.get("accumulate") or (len(args) > 3 and args[3] is True)))
        target = args[0] if args else None
        if accumulate and isinstance(target, torch.Tensor) and not target.is_floating_point():
            self.found.append(f"{name} into {target.dtype}")
        return func(*args, **kwargs)


def test_the_memory_step_accumulates_into_no_integer_tensor():
    cfg = MemoriaConfig(num_wm=4, num_stm_reminded=3, num_ltm_reminded=3, stm_capacity=8, search_depth=2,
                        initial_lifespan=3, capacity=24)
    gen = torch.Generator().manual_seed(0)
    state = MemoryState.empty(cfg, 2, 8)
    for _ in range(6):  # past the first steps: STM and LTM engrams are reminded
        r = remind(state, torch.randn(2, cfg.num_wm, 8, generator=gen), cfg)
        memorize(state, r, torch.rand(r.reminded_slots.shape, generator=gen), cfg)
    with _IntegerAccumulation() as seen:
        r = remind(state, torch.randn(2, cfg.num_wm, 8, generator=gen), cfg)
        memorize(state, r, torch.rand(r.reminded_slots.shape, generator=gen), cfg)
    assert seen.found == [], f"integer accumulation (no int16 atomics on GPUs): {seen.found}"
