"""One run per run directory: an advisory lock that a killed run does not leave behind.

The lock is `fcntl.flock` on `<run_dir>/.lock`: the kernel releases it when the process that
holds it ends, however it ends (kill -9 included), so no stale lock needs cleaning up. The
file says who holds it (pid, host, start time) for the refusal message.

    probe(run_dir)          every rank, before anything expensive: refuse a directory in use
                            (or one that cannot be created or written)
    RunLock(run_dir).acquire()   rank 0, first thing once the ranks have joined: hold it to the end

Every rank probes before it joins the process group and rank 0 acquires only after all have
joined, so the ranks of one run never see their own lock. Rank 0 acquires *before* the run
looks at what the directory holds (whether to resume, which checkpoint): two runs started a
moment apart both pass the probe, and the one that takes the lock second decides on what the
first left behind, never on what was there before it. A probe takes a shared lock for an
instant; the holder's exclusive lock retries for a few seconds, so a probe of another run at
that instant does not make it fail.

Limits: `flock` is per host on some network filesystems (older NFS, some Lustre mounts): two
runs on different hosts over such a mount are not kept apart.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

LOCK_NAME = ".lock"


class RunDirInUse(RuntimeError):
    """Another live run holds the directory."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another run"
    return f"another run (pid {info.get('pid')} on {info.get('host')}, started {info.get('started')})"


def _message(run_dir: Path, path: Path) -> str:
    return (f"run_dir {run_dir} is in use by {_holder(path)}; wait for it to finish, stop it, "
            f"or choose another run_dir")


class RunDirUnusable(ValueError):
    """The run directory cannot be created or written (a file in its place, no permission)."""


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else its closest existing ancestor (what creating it would meet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_usable(run_dir: Path) -> None:
    existing = nearest_existing(run_dir)
    if not existing.is_dir():
        where = "is a file" if existing == run_dir else f"lies under {existing}, which is a file"
        raise RunDirUnusable(f"run_dir {run_dir} {where}; choose a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirUnusable(f"run_dir {run_dir}: {existing} is not writable by this user; choose another run_dir")
    try:  # what `access` cannot tell (root on /proc, a read-only or full filesystem): try, and leave nothing
        os.rmdir(tempfile.mkdtemp(prefix=".probe_", dir=existing))
    except OSError as e:
        raise RunDirUnusable(f"run_dir {run_dir}: nothing can be created in {existing} ({e.strerror}); "
                             f"choose another run_dir") from None


def probe(run_dir: str | os.PathLike) -> None:
    """Raise `RunDirUnusable` if `run_dir` cannot be a directory this process writes, and
    `RunDirInUse` if a live run holds it (nothing is created or kept)."""
    run_dir = Path(run_dir)
    _check_usable(run_dir)
    path = run_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirInUse(_message(run_dir, path)) from None
    finally:
        os.close(fd)  # closing releases the shared lock


class RunLock:
    """The exclusive lock of one run on its directory (held until `release` or process exit)."""

    def __init__(self, run_dir: str | os.PathLike, name: str = LOCK_NAME) -> None:
        """`name`: the lock file's name in `run_dir` (one directory may hold several things to lock)."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / name
        self._fd: int | None = None
        self._created: Path | None = None  # the outermost directory `acquire` created, if any
        self._made_file = False  # whether `acquire` created the lock file

    def acquire(self, wait_s: float = 5.0) -> None:
        """Take the lock (creating the directory), or raise `RunDirInUse` after `wait_s`."""
        existing = nearest_existing(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if existing != self.run_dir:
            self._created = self.run_dir
            while self._created.parent != existing:
                self._created = self._created.parent
        self._made_file = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise RunDirInUse(_message(self.run_dir, self.path)) from None
                time.sleep(0.05)
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (a later probe finds it free)
            self._fd = None

    def abandon(self) -> None:
        """Release, and remove what `acquire` created (the lock file, and directories the run left
        empty): a run refused during set-up leaves the file system as it found it. The lock file
        goes while still held; a run that opened it in that instant holds a lock on a removed file
        (the window is microseconds of a refused run's exit, at a lock file that did not exist)."""
        created, self._created = self._created, None
        if self._made_file and self._fd is not None:
            self.path.unlink(missing_ok=True)
        self._made_file = False
        self.release()
        if created is None:
            return
        for d in [self.run_dir, *self.run_dir.parents]:
            try:
                d.rmdir()  # only if empty
            except OSError:
                return
            if d == created:
                return

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["probe", "RunLock", "RunDirInUse", "LOCK_NAME"]
