#!/usr/bin/env bash
# The main job on the bundled default: set up whatever is missing, then train a tiny
# Memoria GPT-2 under the `deepspeed` launcher on the bundled public-domain book (CPU is
# fine), evaluate it (full and paper protocols, and without its memory: the memory gain),
# checkpoint it and export it.
#
#   bash launch/quickstart.sh [KEY=VALUE ...]     e.g. optim.epochs=2 run_dir=runs/mine
#
# Everything lands in runs/quickstart/ (metrics.jsonl, eval/, checkpoints/, export/).
# It installs only what the main job needs; launch/test.sh adds the test suite's extras.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091
source "$root/launch/setup.sh" main
cd "$root"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export DS_ACCELERATOR=cpu  # no GPU: DeepSpeed on CPU over gloo
fi
mkdir -p runs
cmd=(deepspeed --num_gpus 1 launch/finetune.py --deepspeed ds_configs/cpu.json
     --config launch/configs/quickstart.yaml "$@")
echo "+ ${cmd[*]}"
"${cmd[@]}" 2>&1 | tee runs/quickstart.log
