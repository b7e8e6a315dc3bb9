"""Retrieve: encode -> STM score -> STM reminded -> LTM entry points -> search -> LTM reminded.

SPEC section 1, steps 1-7 (paper section 3.2, Algorithm 1), for all rows at once, with
static shapes and no host synchronisation. Notation as in state.py, plus
    K   candidates being ranked        W  walkers (= K_stm)
    F   LTM engrams found by the search, at most K_stm * (depth + 1)
    R   reminded slots handed to the model (`MemoriaConfig.num_reminded`)

Scores are log-space: `log mean_j exp(-|s - wm_j|^2)` via logsumexp, which ranks exactly
like the paper's mean of `exp(-d^2)` but never underflows to 0 (the official 1.0.0
package ranks all-zero scores, i.e. arbitrarily).

Ties are broken deterministically, never with an RNG:
    * top-k by score: the more recently created engram (larger uid) wins;
    * strongest edge (largest count): the more recently created engram wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import MemoriaConfig
from .memorize import write_working_memory
from .state import LTM, STM, MemoryState

_NEG = -(1 << 30)  # "ineligible" in int32 edge keys; stays negative after adding any count * C


@dataclass
class Retrieval:
    """What one step reminded, handed to the model and then to `memorize`.

    Attributes:
        wm_slots: (B, N) slots holding this step's working memory.
        stm_slots: (B, K_stm) top STM engrams by score, -1 padded. They are the LTM
            search cues; they are reminded to the model only if `use_stm`.
        ltm_slots: (B, K_ltm) LTM engrams reminded, -1 padded ((B, 0) if `use_ltm` is off).
        num_found: (B,) LTM engrams found by the search (all LTM for `exhaustive`).
        evicted: (B,) LTM engrams evicted to make room for this working memory.
        reminded_slots: (B, R) slots of `M_rem` (STM part, then LTM part), -1 padded.
        reminded: (B, R, D) float32 vectors of `M_rem`, zeros where padded.
        reminded_mask: (B, R) True where `reminded_slots` holds a real engram.
    """

    wm_slots: Tensor
    stm_slots: Tensor
    ltm_slots: Tensor
    num_found: Tensor
    evicted: Tensor
    reminded_slots: Tensor
    reminded: Tensor
    reminded_mask: Tensor


# --------------------------------------------------------------------------- scoring
def log_mean_similarity(cand: Tensor, cand_sq: Tensor, wm: Tensor, wm_sq: Tensor) -> Tensor:
    """`log(mean_j exp(-|c - wm_j|^2))` for every candidate c.

    Args:
        cand: (B, K, D) candidate engrams. cand_sq: (B, K) their squared norms.
        wm: (B, N, D) working memory. wm_sq: (B, N) its squared norms.

    Returns:
        (B, K) float32 scores; higher means closer to the working memory.
    """
    # |c|^2 + |w|^2 - 2 c.w as one batched matmul; never a (B, N, K, D) difference tensor
    d2 = torch.baddbmm(cand_sq[:, :, None] + wm_sq[:, None, :], cand, wm.transpose(1, 2), alpha=-2.0)  # (B, K, N)
    d2.clamp_(min=0.0)  # cancellation can leave tiny negatives
    nearest = d2.amin(dim=-1, keepdim=True)  # (B, K, 1)
    # logsumexp around the nearest engram. Terms below e^-80 of the largest (which is 1)
    # cannot change a float32 sum, but as denormals they make exp ~10x slower: cut them.
    total = d2.sub_(nearest).neg_().clamp_(min=-80.0).exp_().sum(dim=-1)  # (B, K)
    return total.log_() - nearest.squeeze(-1) - math.log(wm.shape[1])


def top_by_score(scores: Tensor, uids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Positions of the k best candidates: highest score first, ties to the larger uid.

    Args:
        scores: (B, K) with -inf where a candidate is not real. uids: (B, K) int64.
        k: how many to keep (k <= K).

    Returns:
        (B, k) positions into K, and (B, k) bool: True where the pick is a real candidate.
    """
    by_uid = torch.argsort(uids, dim=1, descending=True, stable=True)
    by_score = torch.argsort(scores.gather(1, by_uid), dim=1, descending=True, stable=True)
    order = by_uid.gather(1, by_score[:, :k])
    return order, scores.gather(1, order) > float("-inf")


def _gather_rows(x: Tensor, slots: Tensor) -> Tensor:
    """x: (B, C, ...) and slots: (B, K) (>= 0) -> (B, K, ...), one flat index_select."""
    B, C = x.shape[:2]
    flat = (slots + torch.arange(B, device=x.device)[:, None] * C).reshape(-1)
    return x.reshape(B * C, *x.shape[2:]).index_select(0, flat).reshape(B, slots.shape[1], *x.shape[2:])


def _pad(slots: Tensor, width: int) -> Tensor:
    if slots.shape[1] >= width:
        return slots
    return torch.cat([slots, slots.new_full((slots.shape[0], width - slots.shape[1]), -1)], dim=1)


def _score_slots(state: MemoryState, slots: Tensor, wm: Tensor, wm_sq: Tensor) -> Tensor:
    """(B, K) scores of the engrams in `slots` ((B, K), -1 = none -> -inf)."""
    safe = slots.clamp(min=0)
    scores = log_mean_similarity(_gather_rows(state.vectors, safe), state.sq_norms.gather(1, safe), wm, wm_sq)
    return scores.masked_fill_(slots < 0, float("-inf"))


def _pick(state: MemoryState, slots: Tensor, scores: Tensor, k: int) -> Tensor:
    """The k best of `slots` by `scores` (uid ties), -1 where fewer exist; (B, k)."""
    uids = state.uid.gather(1, slots.clamp(min=0))
    k_eff = min(k, slots.shape[1])
    pos, real = top_by_score(scores, uids, k_eff)
    return _pad(torch.where(real, slots.gather(1, pos), -1), k)


# --------------------------------------------------------------------------- STM
def stm_slots(state: MemoryState, config: MemoriaConfig) -> Tensor:
    """(B, C_stm) slots of the current STM engrams (any order), -1 padded."""
    key = torch.where(state.kind == STM, state.uid, -1)
    top, pos = key.topk(min(config.stm_capacity, state.capacity), dim=1)
    return torch.where(top >= 0, pos, -1)


def remind_stm(state: MemoryState, wm: Tensor, wm_sq: Tensor, config: MemoriaConfig) -> Tensor:
    """SPEC steps 2-3: the top `K_stm` STM engrams by score; (B, K_stm), -1 padded."""
    cand = stm_slots(state, config)
    return _pick(state, cand, _score_slots(state, cand, wm, wm_sq), config.num_stm_reminded)


# --------------------------------------------------------------------------- LTM graph search
def recency_order(uid: Tensor) -> tuple[Tensor, Tensor]:
    """Slots by creation order, both ways.

    Returns:
        rank: (B, C) int32 rank of each slot by uid (0 = oldest or empty, C-1 = newest).
        order: (B, C) int64 slot of each rank (the inverse permutation).
    """
    order = torch.argsort(uid, dim=1, stable=True)
    rank = torch.empty_like(order, dtype=torch.int32)
    rank.scatter_(1, order, torch.arange(uid.shape[1], device=uid.device, dtype=torch.int32).expand_as(rank))
    return rank, order


def strongest_edges(counts: Tensor, walkers: Tensor, eligible_rank: Tensor, order: Tensor) -> Tensor:
    """For each walker i, the eligible j with the largest `counts[i, j] > 0`.

    Args:
        counts: (B, C, C) co-retrieval counts. walkers: (B, W) slots, -1 = no walker.
        eligible_rank: (B, C) int32 recency rank where j may be stepped to, `_NEG` elsewhere.
        order: (B, C) slot of each recency rank (`recency_order`).

    Returns:
        (B, W) slots, -1 where the walker is absent or has no positive eligible edge.
        Ties go to the most recently created engram.
    """
    B, C = eligible_rank.shape
    rows = _gather_rows(counts, walkers.clamp(min=0)).to(torch.int32)  # (B, W, C)
    cap = (1 << 30) // C - 1  # keeps count * C + rank inside int32
    if torch.iinfo(counts.dtype).max > cap:
        rows.clamp_(max=cap)
    # key = count * C + rank: the count decides, the recency rank breaks ties, and the
    # winner's slot is decoded from its key, so a (fast, vectorised) amax does the argmax
    best = rows.mul_(C).add_(eligible_rank[:, None, :]).amax(dim=2)  # (B, W)
    j = order.gather(1, best.remainder(C).to(torch.int64))
    return torch.where((best >= C) & (walkers >= 0), j, -1)


def unique_slots(slots: Tensor) -> Tensor:
    """(B, W) slots with repeats replaced by -1 (sorted ascending; -1 first)."""
    s, _ = slots.sort(dim=1)
    repeat = torch.zeros_like(s, dtype=torch.bool)
    repeat[:, 1:] = s[:, 1:] == s[:, :-1]
    return s.masked_fill_(repeat, -1)


def search_ltm(state: MemoryState, cues: Tensor, rank: Tensor, order: Tensor, config: MemoriaConfig) -> Tensor:
    """SPEC steps 4-5: entry points from the cues, then `depth` rounds of walking.

    Args:
        cues: (B, K_stm) reminded STM slots, -1 padded.
        rank, order: the recency order of the slots (see `recency_order`).

    Returns:
        (B, K_stm * (depth + 1)) found LTM slots, each at most once, -1 padded.
    """
    B, C = rank.shape
    ltm = state.kind == LTM
    found = torch.zeros(B, C + 1, dtype=torch.bool, device=rank.device)  # column C collects padding
    frontier = unique_slots(strongest_edges(state.counts, cues, torch.where(ltm, rank, _NEG), order))
    found.scatter_(1, torch.where(frontier >= 0, frontier, C), True)
    rounds = [frontier]
    for _ in range(config.search_depth):
        eligible = ltm & ~found[:, :C]
        frontier = unique_slots(strongest_edges(state.counts, frontier, torch.where(eligible, rank, _NEG), order))
        found.scatter_(1, torch.where(frontier >= 0, frontier, C), True)
        rounds.append(frontier)
    return torch.cat(rounds, dim=1)


def remind_ltm(
    state: MemoryState, wm: Tensor, wm_sq: Tensor, cues: Tensor, rank: Tensor, order: Tensor, config: MemoriaConfig
) -> tuple[Tensor, Tensor]:
    """SPEC step 6: the top `K_ltm` of the found LTM engrams.

    Returns:
        (B, K_ltm) reminded LTM slots (-1 padded) and (B,) how many LTM engrams were found.
    """
    if config.search == "graph":
        found = search_ltm(state, cues, rank, order, config)
        scores = _score_slots(state, found, wm, wm_sq)
    else:  # exhaustive: every LTM engram is a candidate; score all slots in one matmul
        found = torch.where(state.kind == LTM, torch.arange(state.capacity, device=wm.device), -1)
        found = found.expand(state.batch_size, -1)
        scores = log_mean_similarity(state.vectors, state.sq_norms, wm, wm_sq).masked_fill_(found < 0, float("-inf"))
    return _pick(state, found, scores, config.num_ltm_reminded), (found >= 0).sum(dim=1)


# --------------------------------------------------------------------------- the whole retrieve stage
@torch.no_grad()
def remind(state: MemoryState, wm: Tensor, config: MemoriaConfig) -> Retrieval:
    """Write this step's working memory into `state` and retrieve `M_rem` (SPEC steps 1-7).

    The state is updated in place (the working memory takes its slots; a full row evicts
    its least-lifespan LTM engrams). Call `memorize` with the result once the model has
    given each reminded engram its attention weight.

    Args:
        state: the memory, B rows.
        wm: (B, N, D) working-memory engrams (any float dtype; stored as detached fp32).
        config: the memory's settings (`state.capacity` must equal `config.capacity`).

    Returns:
        The Retrieval of this step.
    """
    B, N, D = wm.shape
    if N != config.num_wm or B != state.batch_size or D != state.dim:
        raise ValueError(
            f"working memory of shape {tuple(wm.shape)} does not fit a memory of {state.batch_size} rows, "
            f"{config.num_wm} engrams per step, width {state.dim}"
        )
    wm = wm.detach().to(device=state.device, dtype=torch.float32).contiguous()  # (B, N, D)
    rank, order = recency_order(state.uid)
    wm_slots, evicted = write_working_memory(state, wm, rank, config)
    wm_sq = state.sq_norms.gather(1, wm_slots)  # (B, N)

    want_ltm = config.use_ltm and config.num_ltm_reminded > 0
    need_cues = config.use_stm or (want_ltm and config.search == "graph")
    if need_cues and config.num_stm_reminded > 0:
        cues = remind_stm(state, wm, wm_sq, config)
    else:
        cues = wm_slots.new_full((B, config.num_stm_reminded), -1)
    if want_ltm:
        ltm_slots, num_found = remind_ltm(state, wm, wm_sq, cues, rank, order, config)
    else:
        ltm_slots = wm_slots.new_full((B, config.num_ltm_reminded if config.use_ltm else 0), -1)
        num_found = torch.zeros(B, dtype=torch.long, device=wm.device)

    parts = ([cues] if config.use_stm else []) + ([ltm_slots] if config.use_ltm else [])
    reminded_slots = torch.cat(parts, dim=1) if parts else wm_slots.new_empty((B, 0))
    mask = reminded_slots >= 0
    reminded = _gather_rows(state.vectors, reminded_slots.clamp(min=0)) * mask[:, :, None]
    return Retrieval(
        wm_slots=wm_slots, stm_slots=cues, ltm_slots=ltm_slots, num_found=num_found, evicted=evicted,
        reminded_slots=reminded_slots, reminded=reminded, reminded_mask=mask,
    )
