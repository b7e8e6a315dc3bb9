#!/usr/bin/env bash
# Reproduce paper Table 1: language modelling from scratch (GPT-2 small shape) on WikiText-103, PG-19 (segment
# 150) and enwik8 (segment 512): Transformer, Transformer-XL, Compressive Transformer, infinity-former, Memoria. Choices:
# --corpora wikitext103,pg19,enwik8 --models transformer,xl,compressive,infinity,memoria.
#
#   bash launch/repro/table1.sh [--mode run|dry-run|smoke] [--topology single-gpu|node|multinode]
#       [--gpus N] [--hostfile H] [--run-root DIR] [choices above] [-- training overrides]
#   e.g. bash launch/repro/table1.sh --mode run --corpora wikitext103 --models memoria
#
# Flags and modes: launch/repro/common.sh; settings and choices: docs/reproduction.md.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" --table table1 "$@"
