"""Encode (SPEC step 1): this step's working memory takes free slots of the state, in place.

Notation as in state.py. `remind` (retrieve.py) calls this before it retrieves, so that the
new engrams are in the state (and their count rows cleared) when M_rem is looked up.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import MemoriaConfig
from .state import EMPTY, LTM, WM, MemoryState, vector_digest

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
