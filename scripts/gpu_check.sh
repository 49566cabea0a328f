#!/usr/bin/env bash
# Runs rltool's paths written for CUDA on this machine's GPU and prints one table (check,
# figure, result); exits 1 when a check failed. For a bare machine with one CUDA GPU, Python
# and PyTorch but no network: --wheels DIR installs rltool from this checkout with the wheels
# that scripts/gpu_wheels.sh downloaded (never torch: the machine's own build stays).
#   bash scripts/gpu_check.sh --wheels DIR     install, then run every check (under 8 minutes)
#   bash scripts/gpu_check.sh --dry-run        list the checks, run nothing
#   bash scripts/gpu_check.sh --only bf16,hf-engine
# The checks: rltool/app/gpu_checks.py. docs/distributed.md#gpu-check.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }
# need OPTION WHAT "$@": OPTION must be followed by a value
need() { [ $# -ge 4 ] || { echo "gpu_check.sh: $1 needs $2 (see --help)" >&2; exit 2; }; }
py=${PYTHON:-python3}
wheels=""; args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) args+=(--dry-run) ;;
    --wheels) need "$1" "a directory" "$@"; wheels=$2; shift ;;
    --only) need "$1" "check names" "$@"; args+=(--only "$2"); shift ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ " ${args[*]-} " != *" --dry-run "* ]]; then
  "$py" -c "import torch" 2>/dev/null || {
    echo "gpu_check.sh: PyTorch is not importable by $py; this script never installs it" >&2; exit 2; }
  if [ -n "$wheels" ]; then
    [ -d "$wheels" ] || { echo "gpu_check.sh: --wheels $wheels is not a directory" >&2; exit 2; }
    # every wheel carried, then rltool alone: a --lean directory lacks ray and pyarrow,
    # which rltool imports only for the Ray backend and parquet data
    "$py" -m pip install --no-index --find-links "$wheels" "$wheels"/*.whl
    "$py" -m pip install --no-index --find-links "$wheels" --no-deps .
  elif ! "$py" -c "import omegaconf, typer, transformers" 2>/dev/null; then
    echo "gpu_check.sh: rltool's dependencies are missing here: pass --wheels DIR" \
      "(made by scripts/gpu_wheels.sh)" >&2
    exit 2
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's rltool, installed or not
exec "$py" -m rltool.app.gpu_check "${args[@]}"
