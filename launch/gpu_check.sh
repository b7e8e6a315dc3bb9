#!/usr/bin/env bash
# The GPU acceptance check: `pytest -m gpu`, the memory-step and model-step benchmarks, the
# design-card DeepSpeed run in bf16 with kill-and-resume, ZeRO-3 + LoRA at the gpt2-xl shape;
# one report (runs/gpu_check/report.md + report.json). Offline: no hub, no downloads.
#
#   bash launch/gpu_check.sh [--out DIR] [--only tests,memory,model,train,lora] [--presets transformer,KIND,...]
#                             [--backbone SHAPE] [--eager-only] [--deterministic] [--tiny] [--dry-run]
#
# It uses the Python environment it finds (GPU machines are often offline: bring the
# environment; it names what is missing in one line). --dry-run validates every config it
# would use; --tiny runs the whole check at tiny shapes, on CPU too. See benchmarks/gpu_check.py.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC1091
source "$root/launch/find_env.sh"  # the shell's Python if it has memoria_ds, else .venv
python=$PYTHON
cmd=("$python" benchmarks/gpu_check.py "$@")
echo "+ ${cmd[*]}"
"${cmd[@]}"
