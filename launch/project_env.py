"""Run a launch/ script in the project's environment, also from a shell that has not activated it.

    import project_env  # noqa: F401  (first line of every launch/*.py, before any memoria_ds import)

`python launch/evaluate.py ...` in a new shell starts whichever `python` comes first on PATH.
If that Python cannot import memoria_ds and torch, and the checkout has the `.venv` that
`bash launch/quickstart.sh` made, the script starts again under `.venv/bin/python` with the
same arguments (and `.venv/bin` first on PATH, for the programs it starts). Without one, it
stops with one line that says how to make it. Plain Python only: it runs before anything is
installed.
"""

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
NEEDED = ("memoria_ds", "torch", "transformers")


def _ready() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in NEEDED)


def use_project_env() -> None:
    """Return if this Python has what the scripts need; else run the same command under `.venv`."""
    if _ready():
        return
    python = VENV / "bin" / "python"
    if python.is_file() and Path(sys.prefix).resolve() != VENV.resolve():
        argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])  # interpreter flags kept
        env = dict(os.environ, VIRTUAL_ENV=str(VENV), PATH=f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        env.pop("PYTHONHOME", None)
        sys.stdout.flush()
        os.execve(str(python), [str(python), *argv[1:]], env)
    missing = ", ".join(name for name in NEEDED if importlib.util.find_spec(name) is None)
    sys.exit(f"error: {sys.executable} cannot import {missing}. Run `bash launch/quickstart.sh` once (it makes "
             f"{VENV} and the scripts use it), or `pip install -e {ROOT}` into this environment")


use_project_env()
