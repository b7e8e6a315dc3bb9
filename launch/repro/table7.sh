#!/usr/bin/env bash
# Reproduce paper Table 7: memory ablations on sorting, segment 1024, 4/8/16/32/47 segments: Transformer, + working
# memory, + short-term memory, + long-term memory (Memoria; shared with Table 4). Choices:
# --segments 4,8,16,32,47 --models transformer,memoria_wm,memoria_wm_stm,memoria.
#
#   bash launch/repro/table7.sh [--mode run|dry-run|smoke] [--topology single-gpu|node|multinode]
#       [--gpus N] [--hostfile H] [--run-root DIR] [choices above] [-- training overrides]
#   e.g. bash launch/repro/table7.sh --mode dry-run --segments 47
#
# Flags and modes: launch/repro/common.sh; settings and choices: docs/reproduction.md.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" --table table7 "$@"
