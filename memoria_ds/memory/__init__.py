"""The Memoria memory: an explicit fp32 state and pure step functions over it.

A step, for B rows at once::

    retrieval = remind(state, wm, config)          # write WM, retrieve M_rem (in place)
    ...  model attends to wm and retrieval.reminded, giving weights (B, R)
    stats = memorize(state, retrieval, weights, config)

`state` is updated in place (clone it to keep the old one). See docs/algorithm.md.
"""

from .compiled import COMPILE_MODES, MemoryEngine
from .config import MemoriaConfig
from .encode import write_working_memory
from .memorize import memorize
from .retrieval import Retrieval
from .retrieve import log_mean_similarity, remind, search_ltm
from .state import EMPTY, KIND_NAMES, LTM, STM, WM, MemoryState
from .stats import MemoryStats, graph_stats

__all__ = [
    "MemoriaConfig", "MemoryState", "MemoryEngine", "COMPILE_MODES", "Retrieval", "MemoryStats", "remind", "memorize", "write_working_memory",
    "graph_stats", "log_mean_similarity", "search_ltm", "EMPTY", "WM", "STM", "LTM", "KIND_NAMES",
]
