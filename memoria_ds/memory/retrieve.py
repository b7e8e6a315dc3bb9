"""Retrieve: encode -> STM score -> STM reminded -> LTM entry points -> search -> LTM reminded.

SPEC section 1, steps 1-7 (paper section 3.2, Algorithm 1), for all rows at once, with
static shapes and no host synchronisation. Notation as in state.py, plus
    K   candidates being ranked        W  walkers (= K_stm)
    F   LTM engrams found by the search, at most K_stm * (depth + 1)
    R   reminded slots handed to the model (`MemoriaConfig.num_reminded`)

Scores are log-space: `log mean_j exp(-|s - wm_j|^2)`, which ranks exactly like the
paper's mean of `exp(-d^2)` but never underflows to 0 (the official 1.0.0 package ranks
all-zero scores, i.e. arbitrarily). Candidates are scored in chunks of at most
`_CHUNK`, so that the gathered vectors stay in cache and no large temporary is made.

Ties are broken deterministically, never with an RNG:
    * top-k by score: the more recently created engram (larger uid) wins;
    * strongest edge (largest count): the more recently created engram wins.
"""

from __future__ import annotations

import math
import torch
from torch import Tensor

from .config import MemoriaConfig
from .encode import write_working_memory
from .retrieval import Retrieval
from .state import LTM, STM, MemoryState, cache_tuned

_NEG = -(1 << 30)  # "ineligible" in edge keys; stays negative after adding any int16 count * C
_NEG_BOUND = 1 << 30  # int32 keys are used while every count * C + rank stays below this
_CHUNK = 256  # most candidates scored per matmul on a CPU (`cache_tuned`: the gathered (B, chunk, D) block stays in cache)


# --------------------------------------------------------------------------- scoring
def log_mean_similarity(cand: Tensor, cand_sq: Tensor, wm: Tensor, wm_sq: Tensor) -> Tensor:
    """`log(mean_j exp(-|c - wm_j|^2))` for every candidate c.

    Args:
        cand: (B, K, D) candidate engrams. cand_sq: (B, K) their squared norms.
        wm: (B, N, D) working memory. wm_sq: (B, N) its squared norms.

    Returns:
        (B, K) float32 scores; higher means closer to the working memory.
    """
    # |w|^2 + |c|^2 - 2 w.c as one batched matmul, laid out (B, N, K): with the K candidates
    # as the long output dimension the matmul runs about 10% faster than as (B, K, N)
    d2 = torch.baddbmm(wm_sq[:, :, None] + cand_sq[:, None, :], wm, cand.transpose(1, 2), alpha=-2.0)  # (B, N, K)
    d2.clamp_(min=0.0)  # cancellation can leave tiny negatives
    nearest = d2.amin(dim=1, keepdim=True)  # (B, 1, K)
    # logsumexp around the nearest engram. Terms below e^-80 of the largest (which is 1)
    # cannot change a float32 sum, but as denormals they make exp ~10x slower: cut them.
    total = torch.sub(nearest, d2).clamp_(min=-80.0).exp_().sum(dim=1)  # (B, K)
    return total.log_().sub_(nearest.squeeze(1)).sub_(math.log(wm.shape[1]))


class _Rows:
    """Flat row access to a state's (B, C, ...) tensors by (B, K) slot indices."""

    def __init__(self, state: MemoryState) -> None:
        B, C = state.batch_size, state.capacity
        self.B, self.C = B, C
        self.state = state
        self.offset = torch.arange(B, device=state.device)[:, None] * C  # (B, 1)
        self.vectors = state.vectors.view(B * C, state.dim)
        self.sq_norms = state.sq_norms.view(B * C)
        self.digest = state.digest.view(B * C)
        self.counts = state.counts.view(B * C, C)

    def flat(self, slots: Tensor) -> Tensor:
        """(B, K) slots, -1 or C allowed (read as slot 0 or C-1; callers mask) -> (B*K,) flat rows."""
        return (slots.clamp(0, self.C - 1) + self.offset).view(-1)

    def score(self, slots: Tensor, wm: Tensor, wm_sq: Tensor) -> Tensor:
        """(B, K) scores of the engrams in `slots`; -inf where a slot is -1."""
        B, K, D = self.B, slots.shape[1], wm.shape[2]
        if K == 0:  # no candidates at all (e.g. K_stm = 0)
            return wm.new_empty((B, 0))
        flat = self.flat(slots)  # (B*K,)
        sq = self.sq_norms.index_select(0, flat).view(B, K)
        if not cache_tuned(wm.device):  # one gather, one matmul
            scores = log_mean_similarity(torch.index_select(self.vectors, 0, flat).view(B, K, D), sq, wm, wm_sq)
        else:
            size = -(-K // -(-K // _CHUNK))  # K split into equal chunks of at most _CHUNK
            gathered = self.state.buffer("candidates", (B * _CHUNK, D), torch.float32)  # reused by every chunk
            parts = []
            for lo in range(0, K, size):
                chunk = slots[:, lo : lo + size]
                out = gathered[: chunk.numel()]
                cand = torch.index_select(self.vectors, 0, self.flat(chunk), out=out).view(B, chunk.shape[1], D)
                parts.append(log_mean_similarity(cand, sq[:, lo : lo + size], wm, wm_sq))
            scores = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        scores.masked_fill_(slots < 0, float("-inf"))
        return self.share_identical(slots, flat, sq, scores) if K > 1 else scores

    def share_identical(self, slots: Tensor, flat: Tensor, sq: Tensor, scores: Tensor) -> Tensor:
        """`scores` with every group of bit-identical candidate vectors given one score (the
        group's largest), so that the recency tie-break decides between them exactly.

        The batched matmul need not compute the same bits for the same vector in two columns
        (blocking, edge tiles, separate chunks), which would let an older copy outrank a newer
        one. Candidates are sorted by their cached digest (`state.vector_digest`); neighbours
        with equal digests and equal squared norms are one group. (B, K) work only (nothing
        of size D), static shapes, no host sync. `flat` and `sq`: the slots' flat rows
        (`flat`) and squared norms, (B*K,) and (B, K).
        """
        B, K = slots.shape
        # padding gets a key below every digest (|digest| < 2^52): padding groups only with
        # padding, whose scores are all -inf
        key = self.digest.index_select(0, flat).view(B, K).masked_fill_(slots < 0, -(1 << 62))
        key, order = key.sort(dim=1, stable=True)  # (B, K)
        sq = sq.gather(1, order)
        new = (key[:, 1:] != key[:, :-1]) | (sq[:, 1:] != sq[:, :-1])  # (B, K-1): a group starts here
        group = torch.cat([new.new_zeros((B, 1)), new], dim=1).cumsum(dim=1)  # (B, K) group id in order
        best = torch.full_like(scores, float("-inf")).scatter_reduce_(1, group, scores.gather(1, order), "amax")
        return torch.empty_like(scores).scatter_(1, order, best.gather(1, group))


def top_by_score(scores: Tensor, ranks: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Positions of the k best candidates: highest score first, ties to the newer engram.

    One `topk` over an int64 key: the score's float32 bits, mapped so that integer order
    is float order, in the high 32 bits and the recency rank in the low 32. This is exact
    (no rounding) and the keys of real candidates are distinct (their ranks are).

    Args:
        scores: (B, K) float32, -inf where a candidate is not real.
        ranks: (B, K) recency rank of each candidate (`recency_order`; larger = newer).
        k: how many to keep (k <= K).

    Returns:
        (B, k) positions into K, and (B, k) bool: True where the pick is a real candidate.
    """
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0, which then compare equal
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip magnitude bits, so order is kept
    key = (ordered.to(torch.int64) << 32) + ranks
    _, order = key.topk(k, dim=1, largest=True, sorted=True)
    return order, scores.gather(1, order) > float("-inf")


def _pick(rank: Tensor, slots: Tensor, scores: Tensor, k: int) -> Tensor:
    """The k best of `slots` by `scores` (ties: newer), -1 where fewer exist; (B, k)."""
    k_eff = min(k, slots.shape[1])
    pos, real = top_by_score(scores, rank.gather(1, slots.clamp(min=0)), k_eff)
    picked = torch.where(real, slots.gather(1, pos), -1)
    if k_eff < k:
        picked = torch.cat([picked, picked.new_full((picked.shape[0], k - k_eff), -1)], dim=1)
    return picked


# --------------------------------------------------------------------------- STM
def stm_slots(state: MemoryState, config: MemoriaConfig) -> Tensor:
    """(B, C_stm) slots of the current STM engrams (any order), -1 padded."""
    key = torch.where(state.kind == STM, state.uid, -1)
    top, pos = key.topk(min(config.stm_capacity, state.capacity), dim=1)
    return torch.where(top >= 0, pos, -1)


def remind_stm(
    state: MemoryState, rows: _Rows, wm: Tensor, wm_sq: Tensor, rank: Tensor, config: MemoriaConfig,
) -> Tensor:
    """SPEC steps 2-3: the top `K_stm` STM engrams by score; (B, K_stm), -1 padded.

    `rank`: the recency rank of the slots (`recency_order`), for ties.
    """
    cand = stm_slots(state, config)
    return _pick(rank, cand, rows.score(cand, wm, wm_sq), config.num_stm_reminded)


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


def edge_key_dtype(counts_dtype: torch.dtype, capacity: int) -> torch.dtype:
    """int32 when `count * C + rank` always fits (int16 counts), else int64 (int32 counts)."""
    return torch.int32 if torch.iinfo(counts_dtype).max * capacity + capacity < _NEG_BOUND else torch.int64


def strongest_edges(rows: _Rows, walkers: Tensor, eligible_rank: Tensor, order: Tensor, absent: Tensor) -> Tensor:
    """For each walker i, the eligible j with the largest `counts[i, j] > 0`.

    Args:
        rows: flat access to the state. walkers: (B, W) slots, C = no walker.
        eligible_rank: (B, 1, C) recency rank where j may be stepped to, `_NEG` elsewhere,
            in the key dtype (`edge_key_dtype`).
        order: (B, C) slot of each recency rank (`recency_order`).
        absent: 0-dim C in `order`'s dtype (made once per search, not once per round).

    Returns:
        (B, W) slots, C where the walker is absent or has no positive eligible edge.
        Ties go to the most recently created engram.
    """
    C = rows.C
    flat = rows.flat(walkers)  # an absent walker reads slot C-1 (masked below)
    # key = count * C + rank: the count decides, the recency rank breaks ties, and the
    # winner's slot is decoded from its key, so a (fast, vectorised) amax does the argmax.
    if cache_tuned(rows.state.device):
        # on a CPU, widening into the key buffer first, then adding in place, is ~1.5x faster
        # than one mixed-dtype add, which casts through a temporary
        counts = rows.state.buffer("edge_counts", (flat.numel(), C), rows.counts.dtype)
        counts = torch.index_select(rows.counts, 0, flat, out=counts).view(*walkers.shape, C)  # (B, W, C)
        key = rows.state.buffer("edge_keys", (*walkers.shape, C), eligible_rank.dtype)  # (B, W, C)
        key.copy_(counts)
        best = torch.add(eligible_rank, key, alpha=C, out=key).amax(dim=2)  # (B, W)
    else:  # one mixed-dtype add (a GPU casts in the kernel): one launch fewer a round
        counts = rows.counts.index_select(0, flat).view(*walkers.shape, C)  # (B, W, C)
        best = torch.add(eligible_rank, counts, alpha=C).amax(dim=2)  # (B, W), in the key dtype
    j = order.gather(1, best.remainder(C).long())  # no copy where the keys are int64 already
    return torch.where((best >= C) & (walkers < C), j, absent)


def search_ltm(
    state: MemoryState, rows: _Rows, cues: Tensor, rank: Tensor, order: Tensor, config: MemoriaConfig,
) -> Tensor:
    """SPEC steps 4-5: entry points from the cues, then `depth` rounds of walking.

    Walkers landing on the same engram in a round continue as duplicates; they make the
    same picks, so the found set is the same as with one walker, and duplicates are
    removed once at the end.

    Args:
        cues: (B, K_stm) reminded STM slots, -1 padded.
        rank, order: the recency order of the slots (see `recency_order`).

    Returns:
        (B, K_stm * (depth + 1)) found LTM slots, each at most once, -1 padded.
    """
    C = rows.C
    # eligible (LTM, not yet found) -> recency rank, else a large negative; column C absorbs the
    # walkers that found nothing, which are C during the walk (so a round's finds mark themselves
    # ineligible with one scatter). Keys: the narrowest exact dtype on a CPU; int64 elsewhere,
    # where decoding a key then needs no cast (one launch fewer a round).
    key_dtype = edge_key_dtype(state.counts.dtype, C) if cache_tuned(state.device) else torch.int64
    neg = _NEG if key_dtype == torch.int32 else -(1 << 62)
    eligible = torch.where(state.kind == LTM, rank.to(key_dtype), neg)
    eligible = torch.cat([eligible, eligible.new_full((rows.B, 1), neg)], dim=1)
    frontier, found = cues.remainder(C + 1), []  # -1 -> C
    eligible_rank, absent = eligible[:, None, :C], torch.full((), C, dtype=order.dtype, device=order.device)
    for _ in range(config.search_depth + 1):  # round 0: entry points from the cues
        frontier = strongest_edges(rows, frontier, eligible_rank, order, absent)
        eligible.scatter_(1, frontier, neg)  # nothing found: column C
        found.append(frontier)
    # back to -1 for nothing, then drop repeats (one slot found by two walkers of a round): sort,
    # compare neighbours
    found_all = torch.cat(found, dim=1)
    found_all, _ = found_all.masked_fill_(found_all == C, -1).sort(dim=1)
    repeat = torch.zeros_like(found_all, dtype=torch.bool)
    repeat[:, 1:] = (found_all[:, 1:] == found_all[:, :-1]) & (found_all[:, 1:] >= 0)
    return found_all.masked_fill_(repeat, -1)


def remind_ltm(
    state: MemoryState, rows: _Rows, wm: Tensor, wm_sq: Tensor, cues: Tensor, rank: Tensor, order: Tensor,
    config: MemoriaConfig,
) -> tuple[Tensor, Tensor]:
    """SPEC step 6: the top `K_ltm` of the found LTM engrams.

    Returns:
        (B, K_ltm) reminded LTM slots (-1 padded) and (B,) how many LTM engrams were found.
    """
    if config.search == "graph":
        found = search_ltm(state, rows, cues, rank, order, config)
    else:  # exhaustive: every LTM engram is a candidate
        slot = torch.arange(state.capacity, device=wm.device).expand(state.batch_size, -1)
        found = torch.where(state.kind == LTM, slot, -1)
    scores = rows.score(found, wm, wm_sq)
    return _pick(rank, found, scores, config.num_ltm_reminded), (found >= 0).sum(dim=1)


# --------------------------------------------------------------------------- the whole retrieve stage
def assemble(
    rows: _Rows, wm_slots: Tensor, evicted: Tensor, cues: Tensor, ltm_slots: Tensor, num_found: Tensor,
    config: MemoriaConfig,
) -> Retrieval:
    """SPEC step 7: `M_rem` = STM reminded (if `use_stm`) then LTM reminded (if `use_ltm`).

    Gathers the reminded vectors into a fresh tensor (the model keeps it for its backward)
    with zeros where padded. The padded rows are zeroed by index_fill_ with a static-size
    index: a real row's entry points at one spare row past the end, so no data-dependent
    shape is made (and no 0 * NaN: a broadcast masked_fill_ is ~4x slower, a multiply
    would keep NaN).
    """
    B, D = rows.B, rows.vectors.shape[1]
    parts = ([cues] if config.use_stm else []) + ([ltm_slots] if config.use_ltm else [])
    reminded_slots = torch.cat(parts, dim=1) if parts else wm_slots.new_empty((B, 0))
    mask = reminded_slots >= 0
    R = reminded_slots.shape[1]
    gathered = rows.vectors.new_empty((B * R + 1, D))
    torch.index_select(rows.vectors, 0, rows.flat(reminded_slots), out=gathered[: B * R])
    spare = torch.arange(B * R, device=mask.device).masked_fill_(mask.view(-1), B * R)
    reminded = gathered.index_fill_(0, spare, 0.0)[: B * R].view(B, R, D)  # (B, R, D)
    return Retrieval(
        wm_slots=wm_slots, stm_slots=cues, ltm_slots=ltm_slots, num_found=num_found, evicted=evicted,
        reminded_slots=reminded_slots, reminded=reminded, reminded_mask=mask,
    )


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
    rows = _Rows(state)

    want_ltm = config.use_ltm and config.num_ltm_reminded > 0
    need_cues = config.use_stm or (want_ltm and config.search == "graph")
    if need_cues and config.num_stm_reminded > 0:
        cues = remind_stm(state, rows, wm, wm_sq, rank, config)
    else:
        cues = wm_slots.new_full((B, config.num_stm_reminded), -1)
    if want_ltm:
        ltm_slots, num_found = remind_ltm(state, rows, wm, wm_sq, cues, rank, order, config)
    else:
        ltm_slots = wm_slots.new_full((B, config.num_ltm_reminded if config.use_ltm else 0), -1)
        num_found = torch.zeros(B, dtype=torch.long, device=wm.device)

    return assemble(rows, wm_slots, evicted, cues, ltm_slots, num_found, config)
