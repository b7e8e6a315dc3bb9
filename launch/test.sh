#!/usr/bin/env bash
# Set up whatever is missing, then run the test suite (the command .ci/run runs).
#   bash launch/test.sh [PYTEST ARGS...]      e.g. -m slow, -k memory, tests/memory
# The suite runs on MEMORIA_DS_TEST_WORKERS pytest-xdist workers (2: CI's cores; 0 runs it in this
# process, with each file's time on its line), a file to a worker (module fixtures stay shared).
# The 30 slowest tests close the report: CI's log says where its time went.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091
source "$root/launch/setup.sh" test
cd "$root"
workers=${MEMORIA_DS_TEST_WORKERS:-2}
echo "+ python -m pytest -n $workers --dist loadfile --durations=30 $*"
python -m pytest -n "$workers" --dist loadfile --durations=30 "$@"
