"""Parse-only runs of many documented commands without paying Python's start-up for each.

`tests/test_docs_commands.py` checks each of about a hundred commands by running its script under a
shim that stops right after argparse. As one `python -c SHIM ...` per command, each paid the imports of
torch, transformers and DeepSpeed again (8-20 s each on the 2-core VM, a quarter of an hour in all). A
`ParseServer` is one Python process (the reader's interpreter, in the reader's environment, in the
checkout) that imports those libraries once, then forks a child per command: the child runs the shim
exactly as `python -c SHIM kind target args...` would (`sys.orig_argv` too, so a launch/ script that
restarts itself under `.venv` restarts the shim, as before), its stderr kept, its exit status returned.
Each command still gets a process of its own; only the imports are shared.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

LIBRARIES = ("numpy", "torch", "transformers", "datasets", "deepspeed", "memoria_ds.model", "memoria_ds.train.cli",
             "memoria_ds.eval", "memoria_ds.data")  # imported once: most of a script's start-up

SERVER = r"""
import importlib, json, os, signal, sys, tempfile, traceback
shim, libraries = sys.argv[1], sys.argv[2].split(",")
channel = os.fdopen(os.dup(1), "w")  # the replies; whatever the libraries print goes to stderr
os.dup2(2, 1)
for name in libraries:
    try:
        importlib.import_module(name)
    except Exception:
        pass  # the reader's Python may lack it: the command then imports (or restarts) as it would
channel.write("ready\n")
channel.flush()
for line in sys.stdin:
    words = json.loads(line)
    with tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            signal.alarm(300)  # a command that hangs is a failure, not a hung suite
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(err.fileno(), 2)
            sys.argv = ["-c", *words]
            sys.orig_argv = [sys.executable, "-c", shim, *words]
            code = 0
            try:
                exec(compile(shim, "<shim>", "exec"), {"__name__": "__main__"})
            except SystemExit as stop:
                if stop.code is None or isinstance(stop.code, int):
                    code = stop.code or 0
                else:
                    print(stop.code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        reply = {"code": os.waitstatus_to_exitcode(status), "stderr": err.read().decode(errors="replace")[-4000:]}
    channel.write(json.dumps(reply) + "\n")
    channel.flush()
"""


class ParseServer:
    """One interpreter + environment; `run(kind, target, args)` -> (exit status, stderr)."""

    def __init__(self, python: str, env: dict[str, str], cwd: Path, shim: str):
        self.proc = subprocess.Popen([python, "-c", SERVER, shim, ",".join(LIBRARIES)], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline() != "ready\n":
            raise RuntimeError(f"the parse server under {python} did not start (exit {self.proc.poll()})")

    def run(self, kind: str, target: str, args: list[str]) -> tuple[int, str]:
        self.proc.stdin.write(json.dumps([kind, target, *args]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the parse server died (exit {self.proc.poll()})")
        reply = json.loads(line)
        return reply["code"], reply["stderr"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
