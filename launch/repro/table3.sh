#!/usr/bin/env bash
# Reproduce paper Table 3: long-document classification on Hyperpartisan (Longformer's splits), five
# seeds each of BERT and RoBERTa [512], BigBird and Longformer [4096] and Memoria BERT / RoBERTa
# [8 segments of 512]; each run evaluates the validation split at its end, then the test split.
# Choices: --models bert,roberta,bigbird,longformer,memoria_bert,memoria_roberta --seeds 42,43,44,45,46.
#
#   bash launch/repro/table3.sh [--mode run|dry-run|smoke] [--topology single-gpu|node|multinode]
#       [--gpus N] [--hostfile H] [--run-root DIR] [choices above] [-- training overrides]
#   e.g. bash launch/repro/table3.sh --mode dry-run --topology multinode --hostfile hosts --models memoria_roberta
#
# Flags and modes: launch/repro/common.sh; settings and choices: docs/reproduction.md.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" --table table3 "$@"
