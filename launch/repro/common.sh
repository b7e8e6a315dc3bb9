#!/usr/bin/env bash
# Shared by launch/repro/table*.sh; not meant to be called directly.
#
#   bash launch/repro/tableN.sh [--mode run|dry-run|smoke] [planner flags] [-- training overrides]
#
# --mode run      (default) train every selected run at the paper's settings
# --mode dry-run  print each run's exact command, resolved configuration, per-rank batch,
#                 GPU memory per rank, steps and an A100-80GB GPU-hours estimate; run nothing
# --mode smoke    the same pipeline scaled down for CPU (stand-in data, tiny model, a few steps)
#                 (`--mode dry-run --scale smoke` prints the smoke commands without running them)
#
# Every other flag goes to the planner (python -m memoria_ds.repro.plan; `--help` lists
# them): --topology single-gpu|node|multinode, --gpus N, --hostfile H, --launcher pdsh|no-ssh,
# --run-root DIR, --models, --sizes, --corpora, --segment-lengths, --segments, --entries,
# --zero, --gpu-memory-gb, --global-batch, --micro-batch, --count-tokens, --rerun.
# Everything after `--` is appended to every training command. Each command is echoed,
# then run; the command and its output are shown and appended to <run_dir>/launch.log (tee).
set -euo pipefail

# the shell's Python if it has memoria_ds, else the checkout's .venv (sets PYTHON; PYTHON=... overrides)
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/../find_env.sh"
mode=run
args=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --mode) mode=${2:?--mode needs a value}; shift 2 ;;
    --mode=*) mode=${1#--mode=}; shift ;;
    -h|--help)  # the launcher's own flags (--mode), then the planner's
      sed -n '4,17p' "${BASH_SOURCE[0]}" | sed -E 's/^# ?//'
      echo
      exec "$PYTHON" -m memoria_ds.repro.plan --help ;;
    --) args+=("$@"); break ;;
    *) args+=("$1"); shift ;;
  esac
done

case $mode in
  dry-run) planner=("$PYTHON" -m memoria_ds.repro.plan --print report) ;;
  run) planner=("$PYTHON" -m memoria_ds.repro.plan --print commands) ;;
  smoke) planner=("$PYTHON" -m memoria_ds.repro.plan --print commands --scale smoke) ;;
  *) echo "error: --mode must be run, dry-run or smoke, got '$mode'" >&2; exit 2 ;;
esac
planner+=("${args[@]}")

echo "+ ${planner[*]}"
if [[ $mode == dry-run ]]; then
  exec "${planner[@]}"
fi
plan=$("${planner[@]}")   # one `LOG<TAB>COMMAND` line per run (the planner fails loudly)
while IFS=$'\t' read -r -u 3 log cmd; do
  [[ -n ${cmd:-} ]] || continue
  echo "+ $cmd" | tee -a "$log"
  eval "$cmd" 2>&1 | tee -a "$log"
done 3<<< "$plan"
