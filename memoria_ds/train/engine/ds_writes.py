"""DeepSpeed's checkpoint writes, made unable to break its collectives.

`engine.save_checkpoint` is collective: the ranks meet in barriers between and after their
writes. A write that raises on one rank (a full disk, a read-only or vanished directory)
leaves that rank outside the save while the others wait in DeepSpeed's next barrier; the
failed rank then waits in ours, and the job hangs on every rank.

So the engine's writes are guarded where DeepSpeed makes them: its checkpoint engine (the
pluggable writer every state file and folder goes through) and the copy of its recovery
script. A failed write is recorded, its partial file removed, and every later write of that
save skipped; the save goes on through each collective as on the other ranks, and
`GuardedWrites.raise_failure` raises the failure once it has returned. The caller then agrees
with the other ranks on the outcome (checkpoints/store.py: one `CheckpointError` on every rank).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


class _Writer:
    """DeepSpeed's checkpoint engine with `save` and `makedirs` guarded; the rest passes through."""

    def __init__(self, inner: Any, guard: GuardedWrites) -> None:
        self._inner, self._guard = inner, guard

    def save(self, state_dict: Any, path: str) -> None:
        self._guard.write(path, lambda: self._inner.save(state_dict, path), partial=path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._guard.write(path, lambda: self._inner.makedirs(path, exist_ok=exist_ok))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class GuardedWrites:
    """Installed on one DeepSpeed engine (`GuardedWrites(engine)`); call `start()` before each
    save and `raise_failure()` after it."""

    def __init__(self, engine: Any) -> None:
        self.failure: BaseException | None = None
        engine.checkpoint_engine = _Writer(engine.checkpoint_engine, self)
        copy = engine._copy_recovery_script  # DeepSpeed's own file copy (rank 0), outside its checkpoint engine
        engine._copy_recovery_script = lambda save_path: self.write(save_path, lambda: copy(save_path))

    def start(self) -> None:
        self.failure = None

    def write(self, path: str, do: Callable[[], None], partial: str | None = None) -> None:
        if self.failure is not None:  # the save has failed on this rank: write nothing more
            return
        try:
            do()
        except OSError as e:  # disk full, read-only, quota
            self.failure = e
        except RuntimeError as e:  # torch's zip writer on a full disk: "unexpected pos ..." and no errno
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            self.failure = OSError(None, f"torch could not write the file ({first})", path)
            if partial is not None:
                try:
                    os.remove(partial)
                except OSError:
                    pass

    def raise_failure(self) -> None:
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure


__all__ = ["GuardedWrites"]
