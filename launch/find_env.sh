#!/usr/bin/env bash
# Sourced by the launch/ scripts that run in the environment they find (repro/common.sh,
# gpu_check.sh): the shell's own Python if it imports memoria_ds and torch, else the
# checkout's .venv (made by quickstart.sh / test.sh), activated, so that a new shell that
# has not activated it runs them too. Sets PYTHON (one given by the caller is kept).
# Installs nothing: setup.sh does that.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_ready() {
  "$1" -c "import importlib.util as u, sys
sys.exit(0 if all(u.find_spec(m) for m in ('memoria_ds', 'torch', 'transformers')) else 1)" 2>/dev/null
}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=$(command -v python3 || command -v python || echo python3)
  if ! _ready "$PYTHON" && [ -x "$_root/.venv/bin/python" ]; then
    # shellcheck disable=SC1091
    source "$_root/.venv/bin/activate"
    PYTHON=python
  fi
fi
unset _root
unset -f _ready
