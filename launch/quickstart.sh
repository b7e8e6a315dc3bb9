#!/usr/bin/env bash
# The main job on the bundled default: set up whatever is missing, then train a tiny
# Memoria GPT-2 under the `deepspeed` launcher on the bundled public-domain book (CPU is
# fine), evaluate it (full and paper protocols, and without its memory: the memory gain),
# checkpoint it and export it.
#
#   bash launch/quickstart.sh [KEY=VALUE ...]     e.g. optim.epochs=2 run_dir=runs/mine
#
# Everything lands in runs/quickstart/ (metrics.jsonl, eval/, checkpoints/, export/), the
# output also in runs/quickstart.log. Another model (model.preset=P) gets its own run
# directory, runs/quickstart_P, unless run_dir= names one; the log is <run_dir>.log.
# It installs only what the main job needs; launch/test.sh adds the test suite's extras.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091
source "$root/launch/setup.sh" main
cd "$root"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export DS_ACCELERATOR=cpu  # no GPU: DeepSpeed on CPU over gloo
fi
# The run directory: the config's runs/quickstart, one per other preset, or the one named
run_dir=runs/quickstart named="" preset=memoria
expect_dir=0
for arg in "$@"; do
  if [ "$expect_dir" = 1 ]; then run_dir=$arg named=1 expect_dir=0; continue; fi
  case $arg in
    run_dir=*) run_dir=${arg#run_dir=} named=1 ;;
    --run-dir=*) run_dir=${arg#--run-dir=} named=1 ;;
    --run-dir) expect_dir=1 ;;
    model.preset=*) preset=${arg#model.preset=} ;;
  esac
done
extra=()
if [ -z "$named" ] && [ "$preset" != memoria ]; then
  run_dir=runs/quickstart_$preset  # runs/quickstart holds the default model: resuming it as another fails
  extra=("run_dir=$run_dir")
fi
log=${run_dir%/}.log
mkdir -p "$(dirname "$log")"
cmd=(deepspeed --num_gpus 1 launch/finetune.py --deepspeed ds_configs/cpu.json
     --config launch/configs/quickstart.yaml "$@" ${extra[@]+"${extra[@]}"})
echo "+ ${cmd[*]}" | tee "$log"
"${cmd[@]}" 2>&1 | tee -a "$log"
