#!/usr/bin/env bash
# Reproduce paper Table 4: the sorting task, segment lengths 256/512/1024 x 4/8/16/32 segments, Transformer-XL,
# Compressive Transformer, infinity-former and Memoria. Choices: --segment-lengths 256,512,1024 --segments 4,8,16,32 --models xl,compressive,infinity,memoria.
#
#   bash launch/repro/table4.sh [--mode run|dry-run|smoke] [--topology single-gpu|node|multinode]
#       [--gpus N] [--hostfile H] [--run-root DIR] [choices above] [-- training overrides]
#   e.g. bash launch/repro/table4.sh --mode run --topology multinode --hostfile hosts --segment-lengths 1024
#
# Flags and modes: launch/repro/common.sh; settings and choices: docs/reproduction.md.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" --table table4 "$@"
