"""The memory step as compiled graphs (`torch.compile`), with an eager fallback.

`remind` and `memorize` have static shapes and no host synchronisation, so each traces as
one graph (tested: no graph break). Compiled, a step launches a few fused kernels instead
of hundreds of small ones, which is what a GPU's host-bound step pays for. The state is
still updated in place, as in eager mode; the results are the same up to floating-point
summation order (integer and boolean fields exactly, for inputs without near-ties).

    engine = MemoryEngine("default")           # or None: eager, the default
    retrieval = engine.remind(state, wm, config)
    stats = engine.memorize(state, retrieval, weights, config)

If compilation fails (no C++ compiler for inductor on CPU, an unsupported backend), the
engine warns once and runs eagerly from then on; the state is untouched by the failed
attempt (dynamo compiles before it runs anything).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

from .config import MemoriaConfig
from .memorize import memorize
from .retrieval import Retrieval
from .retrieve import remind
from .state import MemoryState, digest_multipliers
from .stats import MemoryStats

# torch.compile's modes; "reduce-overhead" also captures CUDA graphs on a GPU
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


# the modes that capture CUDA graphs on a GPU
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def static_addresses(state: MemoryState, *others: torch.Tensor) -> None:
    """Mark the state's tensors (and `others`) as inputs whose addresses do not change.

    The memory steps update the state in place. CUDA graph trees capture a graph that
    mutates an input only if that input keeps its address (as parameters and buffers do);
    an unmarked mutated input makes inductor skip the graph ("skipping cudagraphs due to
    mutated inputs", seen on an H200 on 2026-11-26). A state replaced by another (a new
    memory) re-records the graph; it does not recompile it. Outside a CUDA graph mode the
    mark changes nothing; inside a traced region it is left out (the tensors are the
    graph's own there).
    """
    if torch.compiler.is_compiling():
        return
    for t in [*state.tensors().values(), *state.scratch.values(), *others]:  # scratch is written in place too
        torch._dynamo.mark_static_address(t)


def error_gist(message: str) -> str:
    """A compiler's error in one line: its first and last lines (Triton and inductor's
    subprocesses put the cause last: "... atomic_add does not support int16")."""
    lines = [x.strip() for x in message.strip().splitlines() if x.strip()]
    return "" if not lines else lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


@functools.cache
def _compiled(fn: Callable, mode: str) -> Callable:
    # one compiled function per (step, mode) in the process: every model shares its graphs
    return torch.compile(fn, mode=mode, dynamic=False)


class MemoryEngine:
    """`remind` and `memorize`, run eagerly (`mode=None`) or as compiled graphs.

    Args:
        mode: None, or one of `COMPILE_MODES` (torch.compile's `mode`).
    """

    def __init__(self, mode: str | None = None) -> None:
        if mode is not None and mode not in COMPILE_MODES:
            raise ValueError(f"memory compile mode must be None or one of {COMPILE_MODES}, got {mode!r}")
        self.mode = mode
        self.fell_back: str | None = None  # why compilation was abandoned, if it was

    @property
    def compiled(self) -> bool:
        return self.mode is not None and self.fell_back is None

    def _run(self, fn: Callable, state: MemoryState, *args):
        # the memory is fp32 by design: under a caller's autocast (engine=torch in bf16) its
        # matmuls would run in bf16, and the score ranking reads float32 bits
        with torch.autocast(state.device.type, enabled=False):
            return self._call(fn, state, *args)

    def _call(self, fn: Callable, state: MemoryState, *args):
        if not self.compiled:
            return fn(state, *args)
        if self.mode in CUDAGRAPH_MODES:
            static_addresses(state)
        try:
            return _compiled(fn, self.mode)(state, *args)
        except torch._dynamo.exc.TorchDynamoException as e:  # compilation, not the step, failed
            cause = getattr(e, "inner_exception", None) or e  # a backend's own error, if it raised one
            self.fell_back = f"{type(cause).__name__}: {error_gist(str(cause))}"
            warnings.warn(f"the memory engine could not be compiled ({self.fell_back[:300]}); running it eagerly",
                          RuntimeWarning, stacklevel=3)
            return fn(state, *args)

    def remind(self, state: MemoryState, wm: torch.Tensor, config: MemoriaConfig) -> Retrieval:
        """`memoria_ds.memory.remind`, compiled if asked."""
        if self.compiled:
            digest_multipliers(state.dim, state.device)  # a constant the graph reads, made outside it
        return self._run(remind, state, wm, config)

    def memorize(self, state: MemoryState, retrieval: Retrieval, weights: torch.Tensor,
                 config: MemoriaConfig) -> MemoryStats:
        """`memoria_ds.memory.memorize`, compiled if asked."""
        return self._run(memorize, state, retrieval, weights, config)


__all__ = ["COMPILE_MODES", "CUDAGRAPH_MODES", "MemoryEngine", "error_gist", "static_addresses"]
