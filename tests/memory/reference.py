"""A slow, plainly written reference of the Memoria memory, for one row at a time.

Written from /work/shared/SPEC.md section 1 and the paper (section 3, Appendix E), not
from the engine in `memoria_ds/memory`. Nothing here is batched or vectorised: engrams
live in a dict keyed by uid, co-retrieval counts in a dict of dicts, every number is a
Python float (float64) or int. It is meant to be obviously correct, not fast.

The decisions SPEC leaves open are fixed as the project decided them:

* Ranking score of a candidate s: ``log(mean_j exp(-|s - wm_j|^2))`` (SPEC step 2, in
  log space). Top-k ties (equal scores): the larger uid (more recently created) wins.
* ``uid = step * N_wm + j`` for the j-th WM engram written at memory step ``step`` of
  the row (the row's step counter starts at 0, +1 per step, back to 0 on reset).
  Creation step = ``uid // N_wm``; age = current step - creation step.
* Count-argmax ties (entry points and search steps): the larger uid wins.
* Capacity: ``capacity`` slots for all engrams. When the new WM does not fit
  (alive + N_wm > capacity), the LTM engrams with the least lifespan are evicted first
  (equal lifespans: the smallest uid first), their counts with them; evictions counted.
* Lifespan increment ``w_i / sum_k w_k * |M_rem| * alpha`` over the real reminded
  engrams only, negative weights clamped to 0; a row whose weights sum to 0 gives every
  reminded engram ``alpha``.
* ``use_stm=False``: the top-K_stm STM engrams are still the cues of the graph search but
  are not reminded (no counts, no lifespan). ``use_ltm=False``: no LTM retrieval.
  ``search="exhaustive"``: every LTM engram is a candidate. ``M_rem`` = STM part (if
  use_stm) then LTM part (if use_ltm), each by score descending.
* Counts saturate: once ``Count[i, i]`` has reached the storage maximum (32767 for int16),
  row i of the counts no longer changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

WM, STM, LTM = "wm", "stm", "ltm"
KIND_CODES = {WM: 1, STM: 2, LTM: 3}  # the engine's int8 codes (0 = empty slot)
COUNT_MAX = {"int16": 2**15 - 1, "int32": 2**31 - 1}


@dataclass
class Engram:
    """One engram of one row: its uid, vector (float64 tuple), kind and lifespan."""

    uid: int
    vector: tuple[float, ...]
    kind: str
    lifespan: float


@dataclass
class RefRetrieval:
    """What `ReferenceMemory.remind` found in one step (all engrams named by uid).

    Attributes:
        wm: uids of this step's working memory, in WM order.
        evicted: uids evicted to make room for the WM (least lifespan first).
        stm: the top-K_stm STM engrams, best first (the cues of the LTM search; reminded
            to the model only if `use_stm`).
        ltm: the top-K_ltm found LTM engrams, best first ([] without LTM retrieval).
        reminded: M_rem in the order handed to the model.
        entry_points: LTM engrams reached from the cues (SPEC step 4).
        rounds: the set of picks of every search round (SPEC step 5), entry points first.
        picks: every walker's pick per round (None: the walker had nowhere to go).
        found: every LTM candidate of SPEC step 6 (all LTM for `exhaustive`).
        scores: score of every ranked candidate (STM engrams and found LTM engrams).
        stm_ranking / ltm_ranking: all candidates in ranking order (for precision checks).
    """

    wm: list[int]
    evicted: list[int]
    stm: list[int]
    ltm: list[int]
    reminded: list[int]
    entry_points: set[int] = field(default_factory=set)
    rounds: list[set[int]] = field(default_factory=list)
    picks: list[list[int | None]] = field(default_factory=list)
    found: set[int] = field(default_factory=set)
    scores: dict[int, float] = field(default_factory=dict)
    stm_ranking: list[int] = field(default_factory=list)
    ltm_ranking: list[int] = field(default_factory=list)
    ltm_retrieval: bool = False


@dataclass
class RefStats:
    """The step statistics the engine's MemoryStats reports, for one row."""

    engrams: dict[str, int]  # after the step: "empty" (free room), "wm", "stm", "ltm"
    evicted: int
    reminded_stm: int
    reminded_ltm: int
    found_ltm: int
    reminded_ltm_age: float  # NaN when no LTM engram was reminded
    lifespan_mean: float  # NaN when the row is empty after the step
    lifespan_max: float  # 0.0 when the row is empty after the step


def score(candidate: Sequence[float], wm: Sequence[Sequence[float]]) -> float:
    """SPEC step 2: ``log(mean_j exp(-||s - wm_j||^2))`` in float64.

    Computed around the nearest WM engram (``-d_min + log(mean_j exp(-(d_j - d_min)))``),
    the same quantity without underflow. The terms are summed with `math.fsum` over the
    sorted distances, so two candidates with the same multiset of distances get exactly
    the same score (an exact tie, decided by uid).
    """
    d2 = sorted(math.fsum((float(a) - float(b)) ** 2 for a, b in zip(candidate, w)) for w in wm)
    nearest = d2[0]
    return -nearest + math.log(math.fsum(math.exp(-(d - nearest)) for d in d2)) - math.log(len(d2))


def top_k(candidates: Mapping[int, float], k: int) -> list[int]:
    """SPEC steps 3 and 6: the k best uids by score, highest first; ties to the larger uid."""
    return ranking(candidates)[:k]


def ranking(candidates: Mapping[int, float]) -> list[int]:
    """All candidate uids, best first (score descending, then uid descending)."""
    return sorted(candidates, key=lambda uid: (-candidates[uid], -uid))


class ReferenceMemory:
    """The memory of one row, step by step, following SPEC section 1.

    Usage per step: ``r = ref.remind(wm)`` (writes the WM, SPEC steps 1-7), then
    ``ref.memorize(r, weights)`` with ``weights`` a mapping uid -> w_i for the engrams of
    ``r.reminded`` (SPEC step 9).
    """

    def __init__(self, config) -> None:
        self.config = config
        self.count_max = COUNT_MAX[config.count_dtype]
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """SPEC "Reset": the row becomes a fresh memory (step 0, no engrams, no counts)."""
        self.engrams: dict[int, Engram] = {}
        self.counts: dict[int, dict[int, int]] = {}  # counts[i][j]; a missing entry is 0
        self.step = 0
        self.evictions = 0

    def count(self, i: int, j: int) -> int:
        """Count[i, j]: how often engrams i and j were in M_act together (0 if never)."""
        return self.counts.get(i, {}).get(j, 0)

    def uids(self, kind: str | None = None) -> list[int]:
        """Alive uids (of one kind), ascending."""
        return sorted(u for u, e in self.engrams.items() if kind is None or e.kind == kind)

    def kinds(self) -> dict[int, str]:
        return {u: e.kind for u, e in self.engrams.items()}

    def lifespans(self) -> dict[int, float]:
        return {u: e.lifespan for u, e in self.engrams.items()}

    def _remove(self, uid: int) -> None:
        """Forget an engram and every count it takes part in."""
        del self.engrams[uid]
        self.counts.pop(uid, None)
        for row in self.counts.values():
            row.pop(uid, None)

    # ------------------------------------------------------------------ step 1 + capacity
    def write_working_memory(self, wm: Sequence[Sequence[float]]) -> tuple[list[int], list[int]]:
        """SPEC step 1 and "Capacity": add the N_wm new engrams (lifespan L0, kind WM).

        If alive + N_wm > capacity, first evict that many LTM engrams, least lifespan first
        (equal lifespans: oldest, i.e. smallest uid, first). Returns (wm uids, evicted uids).
        """
        cfg = self.config
        assert len(wm) == cfg.num_wm
        need = len(self.engrams) + cfg.num_wm - cfg.capacity
        evicted: list[int] = []
        if need > 0:
            by_life = sorted(self.uids(LTM), key=lambda u: (self.engrams[u].lifespan, u))
            assert len(by_life) >= need, "not enough LTM engrams to evict (capacity below the minimum?)"
            evicted = by_life[:need]
            for u in evicted:
                self._remove(u)
            self.evictions += len(evicted)
        new = []
        for j, vec in enumerate(wm):
            uid = self.step * cfg.num_wm + j
            assert uid not in self.engrams
            self.engrams[uid] = Engram(uid, tuple(float(x) for x in vec), WM, float(cfg.initial_lifespan))
            new.append(uid)
        return new, evicted

    # ------------------------------------------------------------------ steps 4-5
    def strongest_edge(self, i: int, eligible: set[int]) -> int | None:
        """The eligible j with the largest Count[i, j] > 0 (ties: larger uid), or None.

        E[i->j] = Count[i, j] / Count[i, i], so for fixed i its argmax is that of Count[i, :].
        """
        best, best_count = None, 0
        for j in eligible:
            c = self.count(i, j)
            if c > 0 and (c > best_count or (c == best_count and j > best)):
                best, best_count = j, c
        return best

    def search(self, cues: Sequence[int]) -> tuple[set[int], list[set[int]], list[list[int | None]]]:
        """SPEC steps 4-5: entry points from the cues, then `search_depth` rounds.

        Round 0: for every cue (a reminded STM engram), its strongest LTM neighbour, only
        along a positive count. Round r: from every engram picked in round r-1, its
        strongest LTM neighbour among those not found in any earlier round; picks of a
        round form a set (walkers landing on the same engram merge), walkers with no
        positive edge left stop. Returns (found, rounds, every walker's pick per round).
        """
        ltm = set(self.uids(LTM))
        picks = [[self.strongest_edge(i, ltm) for i in cues]]
        frontier = {j for j in picks[0] if j is not None}
        found = set(frontier)
        rounds = [set(frontier)]
        for _ in range(self.config.search_depth):
            eligible = ltm - found
            picks.append([self.strongest_edge(i, eligible) for i in sorted(frontier)])
            frontier = {j for j in picks[-1] if j is not None}
            found |= frontier
            rounds.append(set(frontier))
        return found, rounds, picks

    # ------------------------------------------------------------------ steps 1-7
    def remind(self, wm: Sequence[Sequence[float]]) -> RefRetrieval:
        """SPEC steps 1-7 for this row: write the WM, rank STM, search and rank LTM."""
        cfg = self.config
        wm_uids, evicted = self.write_working_memory(wm)
        wm_vecs = [self.engrams[u].vector for u in wm_uids]

        # steps 2-3: every STM engram is scored against the WM; the best K_stm are the cues
        stm_scores = {u: score(self.engrams[u].vector, wm_vecs) for u in self.uids(STM)}
        stm_rank = ranking(stm_scores)
        cues = stm_rank[: cfg.num_stm_reminded]

        # steps 4-6
        ltm_retrieval = cfg.use_ltm and cfg.num_ltm_reminded > 0
        entry, rounds, picks, found = set(), [], [], set()
        if ltm_retrieval:
            if cfg.search == "graph":
                found, rounds, picks = self.search(cues)
                entry = rounds[0]
            else:  # exhaustive: every LTM engram is a candidate
                found = set(self.uids(LTM))
        ltm_scores = {u: score(self.engrams[u].vector, wm_vecs) for u in found}
        ltm_rank = ranking(ltm_scores)
        ltm = ltm_rank[: cfg.num_ltm_reminded] if ltm_retrieval else []

        # step 7
        reminded = (list(cues) if cfg.use_stm else []) + (list(ltm) if cfg.use_ltm else [])
        return RefRetrieval(
            wm=wm_uids, evicted=evicted, stm=cues, ltm=ltm, reminded=reminded, entry_points=entry,
            rounds=rounds, picks=picks, found=found, scores={**stm_scores, **ltm_scores}, stm_ranking=stm_rank,
            ltm_ranking=ltm_rank, ltm_retrieval=ltm_retrieval,
        )

    # ------------------------------------------------------------------ step 9
    def increments(self, reminded: Sequence[int], weights: Mapping[int, float]) -> dict[int, float]:
        """SPEC step 9b: ``w_i / sum_k w_k * |M_rem| * alpha`` (w clamped at 0).

        |M_rem| counts real engrams only. If the weights sum to 0 every engram gets alpha.
        """
        alpha = float(self.config.alpha)
        n = len(reminded)
        w = {u: max(float(weights[u]), 0.0) for u in reminded}
        total = sum(w.values())
        if total > 0:
            return {u: w[u] / total * n * alpha for u in reminded}
        return {u: alpha for u in reminded}

    def memorize(self, r: RefRetrieval, weights: Mapping[int, float]) -> RefStats:
        """SPEC step 9 a-e, in this order, then the step statistics.

        a. Count[i, j] += 1 for every ordered pair of M_act = WM + M_rem, diagonal
           included (a row i whose Count[i, i] is at the storage maximum stays as it is).
        b. lifespan increments of the reminded engrams.
        c. WM becomes STM.
        d. every alive engram loses 1.0; those at <= 0 are removed with their counts.
        e. the oldest STM engrams beyond C_stm become LTM (those that died do not count).
        """
        cfg = self.config
        ages = [self.step - u // cfg.num_wm for u in r.ltm]
        active = list(r.wm) + list(r.reminded)
        assert len(set(active)) == len(active), "M_act holds an engram twice"

        # a. fire together, wire together
        for i in active:
            if self.count(i, i) >= self.count_max:
                continue  # saturated: Count[i, j] <= Count[i, i] must keep holding
            row = self.counts.setdefault(i, {})
            for j in active:
                row[j] = row.get(j, 0) + 1

        # b. lifespan increments
        for u, inc in self.increments(r.reminded, weights).items():
            self.engrams[u].lifespan += inc

        # c. WM -> STM
        for u in r.wm:
            self.engrams[u].kind = STM

        # d. decay and removal
        for e in self.engrams.values():
            e.lifespan -= 1.0
        for u in [u for u, e in self.engrams.items() if e.lifespan <= 0]:
            self._remove(u)

        # e. STM overflow: oldest (smallest uid) first
        stm = self.uids(STM)
        for u in stm[: max(0, len(stm) - cfg.stm_capacity)]:
            self.engrams[u].kind = LTM

        self.step += 1

        lifespans = [e.lifespan for e in self.engrams.values()]
        kinds = [e.kind for e in self.engrams.values()]
        return RefStats(
            engrams={"empty": cfg.capacity - len(self.engrams), WM: kinds.count(WM), STM: kinds.count(STM),
                     LTM: kinds.count(LTM)},
            evicted=len(r.evicted),
            reminded_stm=len(r.stm) if cfg.use_stm else 0,
            reminded_ltm=len(r.ltm),
            found_ltm=len(r.found),
            reminded_ltm_age=sum(ages) / len(ages) if ages else math.nan,
            lifespan_mean=sum(lifespans) / len(lifespans) if lifespans else math.nan,
            lifespan_max=max(lifespans) if lifespans else 0.0,
        )
