#!/usr/bin/env bash
# MbPA++'s lifelong text-classification table (de Masson d'Autume et al. 2019): the four orders of AG News,
# Yelp, Amazon, DBPedia and Yahoo, each as sequential fine-tuning (+ local adaptation alone), replay
# (+ MbPA++) and multitask runs of launch/classify.py (memoria_ds/repro/lifelong.py; docs/episodic.md).
#
#   python -m memoria_ds.data.lifelong_text data/mbpa --source ZHANG_CSV_DIR     # once: the five data sets
#   bash launch/repro/lifelong.sh --data data/mbpa [--mode run|dry-run] [--orders 1,2,3,4]
#       [--methods sequential,replay,multitask] [--run-root runs/mbpa]
#
# --mode dry-run prints every run's command, resolved settings and size; --mode run (default) runs them in
# turn, each command and its output appended to <run_dir>/launch.log.
set -euo pipefail
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/../find_env.sh"
mode=run
args=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --mode) mode=${2:?--mode needs a value}; shift 2 ;;
    --mode=*) mode=${1#--mode=}; shift ;;
    -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed -E 's/^# ?//'; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
case $mode in
  dry-run) exec "$PYTHON" -m memoria_ds.repro.lifelong --print report "${args[@]}" ;;
  run) ;;
  *) echo "error: --mode must be run or dry-run, got '$mode'" >&2; exit 2 ;;
esac
plan=$("$PYTHON" -m memoria_ds.repro.lifelong --print commands "${args[@]}")
while IFS=$'\t' read -r -u 3 log cmd; do
  [[ -n ${cmd:-} ]] || continue
  mkdir -p "$(dirname "$log")"
  echo "+ $cmd" | tee -a "$log"
  eval "$cmd" 2>&1 | tee -a "$log"
done 3<<< "$plan"
