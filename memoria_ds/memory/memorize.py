"""Memorize & Forget (SPEC step 9); the working memory was written by encode.py (step 1).

Notation as in state.py; A = N + R engrams active in a step (`M_act = WM + M_rem`).

Order of the paper's Algorithm 3, as SPEC section 1 fixes it:
    a. counts += 1 for every ordered pair of M_act (diagonal included)
    b. lifespan_i += w_i / sum(w) * |M_rem| * alpha     for i in M_rem (real engrams only)
    c. WM -> STM
    d. every engram loses 1.0 lifespan; those at <= 0 are removed (WM decays in its first step)
    e. the oldest STM engrams beyond C_stm -> LTM
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import MemoriaConfig
from .retrieval import Retrieval
from .state import EMPTY, LTM, STM, MemoryState
from .stats import MemoryStats, collect, reminded_ltm_age


def _add_pair_counts(counts: Tensor, active: Tensor) -> None:
    """counts[b, i, j] += 1 for every ordered pair of real slots in `active` (B, A).

    No atomic adds: every position of the pairs' index is read, incremented and written
    back (`index_copy_`). A step's real pairs are distinct; a padding entry is clamped to
    slot 0 and so names slot 0's pairs, and it adds exactly what the real pair at the same
    position adds (1 if slot 0 is active, else 0): every write to one position writes the
    same value, so duplicates cannot race and the result is exact on every device. (GPU
    compilers have no atomic add for int16: Triton refuses one, which is what an
    `index_add_` of int16 counts compiles to.) Saturation: `counts[i, j] <= counts[i, i]`
    always holds, so a row whose diagonal is below the dtype's maximum cannot overflow; a
    row whose diagonal has reached it (an engram that fired 32,767 times, with int16)
    keeps its counts from then on.
    """
    B, C, _ = counts.shape
    a = active.clamp(min=0)
    real = active >= 0
    # is the slot each entry names an active engram? (padding names slot 0)
    named = real | (active == 0).any(dim=1, keepdim=True)  # (B, A)
    base = torch.arange(B, device=counts.device)[:, None] * (C * C)  # (B, 1)
    row_start = base + a * C  # (B, A) flat position of counts[b, a, 0]
    flat = counts.view(-1)
    diagonal = flat.index_select(0, (row_start + a).reshape(-1)).view(a.shape)  # (B, A)
    room = diagonal < torch.iinfo(counts.dtype).max
    pairs = (row_start[:, :, None] + a[:, None, :]).reshape(-1)  # (B*A*A,)
    add = ((named & room)[:, :, None] & named[:, None, :]).reshape(-1).to(counts.dtype)
    flat.index_copy_(0, pairs, flat.index_select(0, pairs) + add)


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
