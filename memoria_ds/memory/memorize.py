"""Encode (write the working memory) and Memorize & Forget (SPEC steps 1 and 9).

Notation as in state.py; A = N + R engrams active in a step (`M_act = WM + M_rem`).

Order of the paper's Algorithm 3, as SPEC section 1 fixes it:
    a. counts += 1 for every ordered pair of M_act (diagonal included)
    b. lifespan_i += w_i / sum(w) * |M_rem| * alpha     for i in M_rem (real engrams only)
    c. WM -> STM
    d. every engram loses 1.0 lifespan; those at <= 0 are removed (WM decays in its first step)
    e. the oldest STM engrams beyond C_stm -> LTM
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .config import MemoriaConfig
from .state import EMPTY, LTM, STM, WM, MemoryState, vector_digest
from .stats import MemoryStats, collect, reminded_ltm_age

if TYPE_CHECKING:
    from .retrieve import Retrieval

# Allocation keys (int64, smallest taken first): empty slots by index, then LTM engrams by
# (lifespan, age), then never WM/STM. Positive float32 lifespans order like their bit
# patterns, so (bits << 20 | rank) is exact for capacities below 2**20.
_TIER_LTM = 1 << 60
_TIER_NEVER = 2 << 60
MAX_CAPACITY = 1 << 20


def write_working_memory(state: MemoryState, wm: Tensor, rank: Tensor, config: MemoriaConfig) -> tuple[Tensor, Tensor]:
    """SPEC step 1: put N new WM engrams (lifespan L0) into free slots, in place.

    Free slots are taken in ring order from the slot after the newest engram, so a row's
    allocations stay nearly contiguous (which keeps zeroing their count columns cache-friendly). A row without N
    free slots evicts the LTM engrams with the least lifespan (equal lifespans: the oldest
    first). Each taken slot's count row and column are zeroed, which also clears what its
    previous engram left.

    Args:
        state: the memory. wm: (B, N, D) float32 engrams.
        rank: (B, C) recency rank of the slots (`retrieve.recency_order`), for tie-breaks.

    Returns:
        (B, N) slots written (in WM order) and (B,) how many LTM engrams were evicted.
    """
    B, C, D = state.vectors.shape
    N = config.num_wm
    if C >= MAX_CAPACITY:
        raise ValueError(f"capacity {C} is above the supported {MAX_CAPACITY - 1}")
    newest_uid, newest = state.uid.max(dim=1)  # (B,)
    start = torch.where(newest_uid >= 0, newest + 1, 0)  # an empty row starts at slot 0
    ring = (torch.arange(C, device=state.device)[None, :] - start[:, None]).remainder(C)  # (B, C)
    life_bits = state.lifespan.view(torch.int32).to(torch.int64)  # (B, C), order-preserving for > 0
    key = torch.where(
        state.kind == EMPTY,
        ring,
        torch.where(state.kind == LTM, _TIER_LTM + (life_bits << 20) + rank, _TIER_NEVER + ring),
    )
    taken_key, slots = key.topk(N, dim=1, largest=False, sorted=True)  # (B, N)
    evicted = ((taken_key >= _TIER_LTM) & (taken_key < _TIER_NEVER)).sum(dim=1)

    row = torch.arange(B, device=state.device)[:, None]  # (B, 1)
    flat = (slots + row * C).reshape(-1)  # (B*N,)
    state.vectors.view(B * C, D).index_copy_(0, flat, wm.reshape(B * N, D))
    state.sq_norms.view(-1).index_copy_(0, flat, wm.square().sum(dim=-1).reshape(-1))
    state.digest.view(-1).index_copy_(0, flat, vector_digest(wm).reshape(-1))
    state.kind.scatter_(1, slots, WM)
    state.lifespan.scatter_(1, slots, float(config.initial_lifespan))
    new_uid = state.step[:, None] * N + torch.arange(N, device=state.device)  # (B, N)
    state.uid.scatter_(1, slots, new_uid)
    state.counts.view(B * C, C).index_fill_(0, flat, 0)  # rows of the new engrams
    # and their columns, counts[b, :, slots[b, n]]: indexing dims 0 and 2 around a full slice
    # is one offset per (b, n) and a strided run over the rows (a scatter_ with a (B, C, N)
    # index is 4-8x slower); every write is 0, so the order of writes cannot matter
    state.counts[row, :, slots] = 0
    state.evictions.add_(evicted)
    return slots, evicted


def _add_pair_counts(counts: Tensor, active: Tensor) -> None:
    """counts[b, i, j] += 1 for every ordered pair of real slots in `active` (B, A).

    A step's real pairs are distinct; padding pairs (clamped to slot 0) add 0, so the
    accumulate is exact and order-free (deterministic on every device). Saturation:
    `counts[i, j] <= counts[i, i]` always holds, so a row whose diagonal is below the
    dtype's maximum cannot overflow; a row whose diagonal has reached it (an engram that
    fired 32,767 times, with int16) keeps its counts from then on.
    """
    B, C, _ = counts.shape
    real = active >= 0
    a = active.clamp(min=0)
    base = torch.arange(B, device=counts.device)[:, None] * (C * C)  # (B, 1)
    row_start = base + a * C  # (B, A) flat position of counts[b, a, 0]
    diagonal = counts.view(-1).index_select(0, (row_start + a).reshape(-1)).view(a.shape)  # (B, A)
    room = diagonal < torch.iinfo(counts.dtype).max
    pairs = (row_start[:, :, None] + a[:, None, :]).reshape(-1)  # (B*A*A,)
    ones = ((real & room)[:, :, None] & real[:, None, :]).reshape(-1).to(counts.dtype)
    counts.view(-1).index_add_(0, pairs, ones)


@torch.no_grad()
def memorize(state: MemoryState, retrieval: Retrieval, weights: Tensor, config: MemoriaConfig) -> MemoryStats:
    """SPEC step 9 (paper Algorithm 3), in place, after the model has used `retrieval`.

    Args:
        state: the memory `retrieval` came from (no other step in between).
        retrieval: the result of `remind` for this step.
        weights: (B, R) contribution of each reminded engram: the mean attention
            probability it received. Padding positions are ignored; a non-finite or
            negative weight counts as 0. If a row's real weights sum to 0, its lifespan
            increment is shared equally.
        config: the memory's settings.

    Returns:
        Statistics of this step (tensors; nothing is synchronised).
    """
    slots, mask = retrieval.reminded_slots, retrieval.reminded_mask
    if weights.shape != slots.shape:
        raise ValueError(f"weights of shape {tuple(weights.shape)} for {tuple(slots.shape)} reminded engrams")
    ltm_age = reminded_ltm_age(state, retrieval, config)  # before any engram dies

    # a. fire together, wire together: all ordered pairs of M_act, diagonal included
    _add_pair_counts(state.counts, torch.cat([retrieval.wm_slots, slots], dim=1))

    # b. lifespan increments; |M_rem| counts real engrams only
    # padding is ignored whatever it holds (NaN * 0 would be NaN); a non-finite or negative
    # weight of a real engram counts as 0, so a NaN can never make an engram immortal
    w = torch.where(mask, weights.detach().to(torch.float32), 0.0)
    w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0).clamp_(min=0.0)
    total = w.sum(dim=1, keepdim=True)
    n_rem = mask.sum(dim=1, keepdim=True).to(torch.float32)
    share = torch.where(total > 0, w / total.clamp(min=torch.finfo(torch.float32).tiny), mask / n_rem.clamp(min=1.0))
    state.lifespan.scatter_add_(1, slots.clamp(min=0), share * n_rem * float(config.alpha))

    # c. WM becomes STM
    state.kind.scatter_(1, retrieval.wm_slots, STM)

    # d. everything alive loses 1.0; at <= 0 it is gone
    alive = state.kind != EMPTY
    state.lifespan.sub_(alive.to(torch.float32))
    dead = alive & (state.lifespan <= 0)
    state.kind.masked_fill_(dead, EMPTY)
    state.lifespan.masked_fill_(dead, 0.0)
    state.uid.masked_fill_(dead, -1)

    # e. the oldest STM engrams beyond C_stm become LTM (at most N per step)
    stm = state.kind == STM
    excess = (stm.sum(dim=1) - config.stm_capacity).clamp(min=0)  # (B,)
    k = min(config.num_wm, state.capacity)
    _, oldest = torch.where(stm, -state.uid, torch.iinfo(torch.int64).min).topk(k, dim=1)  # oldest first
    move = torch.arange(k, device=state.device)[None, :] < excess[:, None]
    state.kind.scatter_(1, oldest, torch.where(move, LTM, state.kind.gather(1, oldest)))

    state.step.add_(1)
    return collect(state, retrieval, ltm_age, config)
