#!/usr/bin/env bash
# Set up whatever is missing to run memoria_ds, then leave the environment active.
#
#   source launch/setup.sh [EXTRAS]     # EXTRAS: pip extras, default "test"
#
# Uses the active virtual environment if there is one, else creates ./.venv.
# torch goes in first: `torch==2.13.0` (the CPU build that lies on the project's machines;
# on a CUDA machine PyPI gives the CUDA build). Set TORCH_SPEC to choose another build.
# A second run with nothing changed costs a second: a stamp remembers what was installed.
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_extras=${1:-test}
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x "$_root/.venv/bin/python" ]; then
    echo "+ python3 -m venv $_root/.venv"
    python3 -m venv "$_root/.venv"
  fi
  # shellcheck disable=SC1091
  source "$_root/.venv/bin/activate"
fi
_stamp="$VIRTUAL_ENV/.memoria_ds-$_extras.stamp"
_want=$(cat "$_root/pyproject.toml" | sha256sum | cut -c1-16)
if [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; then
  if ! python -c "import torch" 2>/dev/null; then
    echo "+ pip install ${TORCH_SPEC:-torch==2.13.0}"
    python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
  fi
  echo "+ pip install -e $_root[$_extras]"
  python -m pip install --quiet -e "$_root[$_extras]"
  echo "$_want" > "$_stamp"
fi
unset _root _extras _stamp _want
