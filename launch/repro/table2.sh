#!/usr/bin/env bash
# Reproduce paper Table 2: WikiText-103 from scratch with segment length 50 (Memoria N_wm = K_stm = K_ltm = 16,
# C_stm = 128). Choices: --models transformer,xl,compressive,infinity,memoria.
#
#   bash launch/repro/table2.sh [--mode run|dry-run|smoke] [--topology single-gpu|node|multinode]
#       [--gpus N] [--hostfile H] [--run-root DIR] [choices above] [-- training overrides]
#   e.g. bash launch/repro/table2.sh --mode smoke
#
# Flags and modes: launch/repro/common.sh; settings and choices: docs/reproduction.md.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" --table table2 "$@"
