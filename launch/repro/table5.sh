#!/usr/bin/env bash
# Reproduce paper Table 5: pretrained GPT-2, GPT-2 Large, GPT-2 XL fine-tuned on WikiText-103, plain and with
# Memoria (bf16; ZeRO stage chosen to fit --gpu-memory-gb). Choices: --sizes gpt2,gpt2-large,gpt2-xl
# --models transformer,memoria.
#
#   bash launch/repro/table5.sh [--mode run|dry-run|smoke] [--topology single-gpu|node|multinode]
#       [--gpus N] [--hostfile H] [--run-root DIR] [choices above] [-- training overrides]
#   e.g. bash launch/repro/table5.sh --mode dry-run --topology node --gpus 8 --sizes gpt2-xl
#
# Flags and modes: launch/repro/common.sh; settings and choices: docs/reproduction.md.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" --table table5 "$@"
