#!/usr/bin/env bash
# Set up whatever is missing to run memoria_ds, then leave the environment active.
#
#   source launch/setup.sh main      # what the main job needs (quickstart.sh)
#   source launch/setup.sh EXTRAS    # and pip extras, e.g. "test" (test.sh), "test,bench"
#
# Always name one (`main` for none): a script sourced without arguments sees its caller's
# arguments as its own (quickstart.sh's `optim.epochs=2` would be read as extras).
#
# Uses the active virtual environment if there is one, else creates ./.venv.
# torch goes in first: `torch==2.13.0` (the CPU build that lies on the project's machines;
# on a CUDA machine PyPI gives the CUDA build). Set TORCH_SPEC to choose another build.
# A second run with nothing changed costs a second: a stamp per set of extras remembers what
# was installed for this pyproject.toml, and any stamp covers the main job (every set holds it).
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_extras=${1:?"name the pip extras to install, or main for none"}
if [ "$_extras" = main ]; then _extras=""; fi
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x "$_root/.venv/bin/python" ]; then
    echo "+ python3 -m venv $_root/.venv"
    python3 -m venv "$_root/.venv"
  fi
  # shellcheck disable=SC1091
  source "$_root/.venv/bin/activate"
fi
_want=$(sha256sum < "$_root/pyproject.toml" | cut -c1-16)
_stamp="$VIRTUAL_ENV/.memoria_ds-${_extras:-main}.stamp"
_stamps=("$_stamp")
if [ -z "$_extras" ]; then _stamps=("$VIRTUAL_ENV"/.memoria_ds-*.stamp); fi
_have=0
for _s in "${_stamps[@]}"; do
  if [ "$(cat "$_s" 2>/dev/null)" = "$_want" ]; then _have=1; fi
done
if [ "$_have" = 0 ]; then
  if ! python -c "import torch" 2>/dev/null; then
    echo "+ pip install ${TORCH_SPEC:-torch==2.13.0}"
    python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
  fi
  _spec="$_root${_extras:+[$_extras]}"
  echo "+ pip install -e $_spec"
  python -m pip install --quiet -e "$_spec"
  echo "$_want" > "$_stamp"
fi
unset _root _extras _stamp _stamps _s _have _want _spec
