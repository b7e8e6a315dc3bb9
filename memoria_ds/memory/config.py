"""MemoriaConfig: every size and rate of the memory, validated at construction.

Names follow the paper (section 3, Appendix B) and SPEC section 1:

    num_wm          N_wm    working-memory engrams written per step
    num_stm_reminded K_stm  engrams reminded from short-term memory
    num_ltm_reminded K_ltm  engrams reminded from long-term memory
    stm_capacity    C_stm   short-term memory capacity
    initial_lifespan L0     lifespan of a new engram
    alpha                   lifespan extend scale
    search_depth            LTM search depth (rounds after the entry points)
    capacity                fixed engram slots per row (all kinds together)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from ..setting_rules import SettingError

SearchStrategy = Literal["graph", "exhaustive"]
_STRATEGIES = ("graph", "exhaustive")
CountDtype = Literal["int16", "int32"]
_COUNT_DTYPES = ("int16", "int32")

# The default capacity is `steady_state_bound` (which already carries a C_stm margin over
# the paper's analytic steady state) times this, rounded up to a multiple of 64.
CAPACITY_SAFETY = 1.0


@dataclass(frozen=True)
class MemoriaConfig:
    """Settings of one Memoria memory. Defaults are the paper's WikiText-103 settings.

    Args:
        num_wm: N_wm, working-memory engrams per step (the abstractor's queries).
        num_stm_reminded: K_stm, engrams reminded from STM per step.
        num_ltm_reminded: K_ltm, engrams reminded from LTM per step.
        stm_capacity: C_stm, short-term memory capacity.
        initial_lifespan: L0, lifespan of a new engram (> 0).
        alpha: lifespan extend scale (>= 0); a step hands out `alpha * |M_rem|` lifespan.
        search_depth: rounds of LTM graph search after the entry points (>= 0).
        capacity: engram slots per row. `None` picks `steady_state_bound` rounded up to a
            multiple of 64 (1,664 for the defaults: 1.32x the paper's analytic steady state
            of 1,250 engrams and 1.43x the most measured, see docs/algorithm.md). When a
            row is full the LTM engram with the least lifespan is evicted (counted in the
            statistics, `evictions`); raise `capacity` if that happens often.
        use_stm: remind STM engrams to the model (paper Table 7 ablation). When False,
            the top-`K_stm` STM engrams are still computed as the cues of the LTM graph
            search, but they are not given to the model and get no lifespan.
        use_ltm: remind LTM engrams to the model (paper Table 7 ablation).
        search: `"graph"` (the paper: entry points and depth-limited walk along counts)
            or `"exhaustive"` (score every LTM engram; what the authors' code does in
            practice, see docs/algorithm.md).
        count_dtype: storage of the co-retrieval counts, `"int16"` (default: half the
            memory of the dominant `C x C` matrix; a count saturates at 32,767
            co-retrievals of one pair) or `"int32"` (exact for any realistic stream).

    Raises:
        SettingError: a size that cannot work, naming the setting, with the fix in the message.
    """

    num_wm: int = 50
    num_stm_reminded: int = 50
    num_ltm_reminded: int = 50
    stm_capacity: int = 400
    initial_lifespan: float = 9.0
    alpha: float = 8.0
    search_depth: int = 10
    capacity: int | None = None
    use_stm: bool = True
    use_ltm: bool = True
    search: SearchStrategy = "graph"
    count_dtype: CountDtype = "int16"

    def __post_init__(self) -> None:
        for name in ("num_wm", "num_stm_reminded", "num_ltm_reminded", "stm_capacity", "search_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SettingError(name, f"must be an integer, got {value!r}")
        if self.num_wm < 1:
            raise SettingError("num_wm", f"({self.num_wm}) must be at least 1: the memory needs engrams to store")
        for name in ("num_stm_reminded", "num_ltm_reminded", "search_depth"):
            if getattr(self, name) < 0:
                raise SettingError(name, f"({getattr(self, name)}) must be >= 0")
        if self.stm_capacity < 1:
            raise SettingError("stm_capacity", f"({self.stm_capacity}) must be at least 1")
        if self.num_stm_reminded > self.stm_capacity:
            raise SettingError(
                "stm_capacity", f"({self.stm_capacity}) must be at least `num_stm_reminded` "
                f"({self.num_stm_reminded}): STM can never hold that many engrams to remind"
            )
        for name in ("initial_lifespan", "alpha"):  # a bool is no number here
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise SettingError(name, f"must be a finite number, got {value!r}")
        if self.initial_lifespan <= 0:
            raise SettingError(
                "initial_lifespan", f"({self.initial_lifespan}) must be > 0: engrams would die before being stored"
            )
        if self.alpha < 0:
            raise SettingError("alpha", f"({self.alpha!r}) must be a finite number >= 0")
        for name in ("use_stm", "use_ltm"):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.search not in _STRATEGIES:
            raise SettingError("search", f"must be one of {_STRATEGIES}, got {self.search!r}")
        if self.count_dtype not in _COUNT_DTYPES:
            raise SettingError("count_dtype", f"must be one of {_COUNT_DTYPES}, got {self.count_dtype!r}")
        if self.capacity is None:
            object.__setattr__(self, "capacity", self.default_capacity())
        elif isinstance(self.capacity, bool) or not isinstance(self.capacity, int):
            raise SettingError("capacity", f"must be an integer or None, got {self.capacity!r}")
        minimum = self.min_capacity
        if self.capacity < minimum:
            raise SettingError(
                "capacity", f"({self.capacity}) must be at least `stm_capacity + num_wm` ({minimum}) so that a "
                f"new step's working memory always finds room; the default for these sizes is "
                f"{self.default_capacity()} (steady state about {self.steady_state_bound})"
            )

    @property
    def min_capacity(self) -> int:
        """Smallest capacity that always has room for a new working memory."""
        return self.stm_capacity + self.num_wm

    @property
    def steady_state_bound(self) -> int:
        """SPEC section 1's bound on the engrams per row (paper Appendix E).

        Lifespan handed out per step is `N_wm * L0` (new engrams) plus at most
        `alpha * (K_stm + K_ltm)` (reminded engrams); every engram spends 1.0 per step, so
        the number alive settles near their sum (1,250 for the defaults). `C_stm` is added
        on top as a margin.
        """
        handed_out = self.num_wm * self.initial_lifespan + self.alpha * (self.num_stm_reminded + self.num_ltm_reminded)
        return int(math.ceil(handed_out)) + self.stm_capacity

    def default_capacity(self) -> int:
        """`CAPACITY_SAFETY` x `steady_state_bound` (at least `min_capacity`), rounded up to 64."""
        raw = max(CAPACITY_SAFETY * self.steady_state_bound, self.min_capacity)
        return int(math.ceil(raw / 64.0) * 64)

    @property
    def num_reminded(self) -> int:
        """Slots of reminded engrams handed to the model per step (`|M_rem|` at most)."""
        return self.num_stm_reminded * int(self.use_stm) + self.num_ltm_reminded * int(self.use_ltm)

    @property
    def num_found(self) -> int:
        """Most LTM engrams the graph search can find: entry points plus `depth` rounds."""
        return self.num_stm_reminded * (self.search_depth + 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MemoriaConfig:
        """Build from a mapping; unknown keys are an error that names the known ones (SettingError)."""
        known = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            more = f" (so are {unknown[1:]})" if len(unknown) > 1 else ""
            raise SettingError(unknown[0], f"is an unknown Memoria setting{more}; known: {known}")
        return cls(**values)

    @classmethod
    def for_segment_length(cls, segment_length: int, **overrides: Any) -> MemoriaConfig:
        """The paper's sorting-task rule (Appendix B.1): sizes proportional to the segment.

        `N_wm` = 1/8, `K_stm` = 1/4, `K_ltm` = 5/8 and `C_stm` = 1/2 of the segment
        length, `L0 = 5`, `alpha = 8`, `depth = 10`.
        """
        values: dict[str, Any] = dict(
            num_wm=max(1, segment_length // 8),
            num_stm_reminded=segment_length // 4,
            num_ltm_reminded=segment_length * 5 // 8,
            stm_capacity=max(1, segment_length // 2),
            initial_lifespan=5.0,
            alpha=8.0,
            search_depth=10,
        )
        values.update(overrides)
        return cls(**values)
