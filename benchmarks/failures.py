"""A failure that explains itself: what was raised, where in the project's code, and the whole
traceback or child's stderr, kept for the log and the report.

On an H200 two failures left nothing to act on: a benchmark's worker died and only its
`CalledProcessError` was printed (the worker's stderr was dropped), and a variant's bare
`AssertionError:` was recorded without its traceback. Every benchmark now builds its failure
records here:

    failure = from_exception(e)           # in-process: the error, where, the traceback
    failure = from_child(proc)            # a subprocess that exited non-zero: the same from its stderr
    failure.line(log)                     # one line for a report: error, file:line and the log's path

`where` is the innermost frame in the project's own code (`memoria_ds/`, `benchmarks/`,
`launch/`), with its source line: the operation that failed. A compiler's error counts too:
torch.compile puts the user's frames in its message ("from user code: File ..."), and those
come last in the text, so a kind that cannot be captured is named by the operation and
file:line that stopped the capture.
"""

from __future__ import annotations

import re
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("memoria_ds", "benchmarks", "launch")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
_HEADER = "Traceback (most recent call last):"
_RANK = re.compile(r"^\[rank\d+\]: ?")  # torch.distributed's prefix on a rank's stderr lines (the deepspeed launcher)


def _lines(text: str) -> list[str]:
    """`text`'s lines without a rank's `[rankN]: ` prefix."""
    return [_RANK.sub("", x) for x in text.splitlines()]


@dataclass(frozen=True)
class Failure:
    error: str  # "Type: message" in one line (a long message's first and last lines)
    where: str | None  # "memoria_ds/memory/retrieve.py:88 in _pick: `x = ...`", the innermost frame of ours
    detail: str  # the whole traceback, or the child's whole stderr

    def line(self, log: str | Path | None = None) -> str:
        """One line for a report."""
        return (self.error + (f" at {self.where}" if self.where else "")
                + (f" (full traceback: {log})" if log else ""))

    def as_dict(self) -> dict:
        return asdict(self)


def line_of(record: dict, log: str | Path | None = None) -> str:
    """`Failure.line` of a failure kept as a dict (a benchmark's JSON: `error`, `where`, any other keys)."""
    return Failure(record["error"], record["where"], "").line(log)


def _ours(path: str) -> str | None:
    """`path` relative to the project root when it is the project's own code."""
    try:
        rel = Path(path).resolve().relative_to(ROOT)
    except (ValueError, OSError):
        return None
    return rel.as_posix() if rel.parts and rel.parts[0] in OURS else None


def _frames(lines: list[str]) -> str | None:
    """The last frame of the project's own code among `lines`, with its source line."""
    found = None
    for i, raw in enumerate(lines):
        m = _FRAME.match(raw)
        if not m or (rel := _ours(m["file"])) is None:
            continue
        found = f"{rel}:{m['line']} in {m['func']}"
        code = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if code and not _FRAME.match(lines[i + 1]) and not code.startswith(("^", "~")):
            found += f": `{code}`"
    return found


def where(text: str) -> str | None:
    """Where the project's own code failed, from a formatted traceback: the innermost of our
    frames in a compiler's "from user code:" section if there is one (the operation that
    stopped a capture), else in the first traceback that has one of ours (the root cause of
    a chain: `raise ... from e` prints the cause first), else anywhere in `text`."""
    lines = _lines(text)
    user = [i for i, x in enumerate(lines) if x.strip() == "from user code:"]
    if user and (found := _frames(lines[user[-1]:])):
        return found
    starts = [i for i, x in enumerate(lines) if x.strip().endswith(_HEADER)]
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        if found := _frames(lines[a:b]):
            return found
    return _frames(lines)


def _raised(text: str) -> str | None:
    """The exception line after the last traceback in `text` (the first unindented line after
    its frames), with the message's following lines up to a blank one."""
    lines = _lines(text)
    start = max((i for i, x in enumerate(lines) if x.strip().endswith(_HEADER)), default=None)
    if start is None:
        return None
    rest = lines[start + 1:]
    first = next((i for i, x in enumerate(rest) if x.strip() and not x[:1].isspace() and not _FRAME.match(x)), None)
    if first is None:
        return None
    message = []
    for x in rest[first:]:
        if not x.strip():
            break
        message.append(x)
    return _gist("\n".join(message))


# torch.compile's advice and frame listings in its messages: not the error (the frames give `where`)
_BOILERPLATE = ("Set TORCHDYNAMO_VERBOSE", "For more details about this graph break", "from user code:",
                "You can suppress this exception", "Set TORCH_LOGS", "Explanation:", "Hint:", "Developer debug context")


def _gist(message: str) -> str:
    """A message in one line: its first and last lines (a compiler puts the cause last), or only
    its first where torch.compile's advice and frame listings follow it (the frames give `where`)."""
    from memoria_ds.memory.compiled import error_gist  # (here: the GPU check names a missing torch in one line)

    if any(x.strip().startswith(_BOILERPLATE) for x in message.splitlines()):
        message = next((x for x in message.splitlines() if x.strip()), "")
    return error_gist(message)[:400]


def from_exception(e: BaseException) -> Failure:
    detail = "".join(traceback.format_exception(e))
    message = _gist(str(e))
    return Failure(error=f"{type(e).__name__}: {message}" if message else f"{type(e).__name__} (no message)",
                   where=where(detail), detail=detail)


def from_child(proc: subprocess.CompletedProcess, what: str = "") -> Failure:
    """A subprocess that exited with a status other than the expected one: its last exception
    (or, with none, its last line of stderr) and where it was raised."""
    err = proc.stderr or ""
    tail = next((x.strip() for x in reversed(_lines(err)) if x.strip()), "")
    error = _raised(err) or tail or "no output on stderr"
    return Failure(error=f"{what + ' ' if what else ''}exit {proc.returncode}: {error}", where=where(err), detail=err)


class ChildFailed(RuntimeError):
    """`run_child` raises this, carrying the child's failure; its message is the failure's line."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.line())
        self.failure = failure


def run_child(cmd: list[str], what: str = "worker", **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` with captured text output; a non-zero exit prints the child's whole stderr
    (which a `CalledProcessError` drops) to ours, for the log, and raises `ChildFailed` with the
    child's error and where it was raised."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr, flush=True)
        raise ChildFailed(from_child(proc, what))
    return proc
