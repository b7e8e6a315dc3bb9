#!/usr/bin/env bash
# Set up whatever is missing, then run the test suite (the command .ci/run runs).
#   bash launch/test.sh [PYTEST ARGS...]      e.g. -m slow, -k memory, tests/memory
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091
source "$root/launch/setup.sh" test
cd "$root"
echo "+ python -m pytest $*"
python -m pytest "$@"
