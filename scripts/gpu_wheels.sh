#!/usr/bin/env bash
# Downloads, HERE (with the package index), the wheels rltool needs on a GPU machine that has
# Python and a CUDA PyTorch but no network: rltool's runtime dependencies from pyproject.toml
# (scripts/gpu_wheels.py, torch left out) with their own dependencies, and setuptools to build
# rltool. Carry DIR with the checkout and run `bash scripts/gpu_check.sh --wheels DIR` there.
#   bash scripts/gpu_wheels.sh DIR [--python-version 3.12] [--lean]
# --python-version: the GPU machine's Python when it differs from this one (manylinux x86_64
# wheels are then fetched for it). --lean: without ray and pyarrow, which the checks never
# import (about 60 MB instead of 190). Wheels only (--only-binary=:all:): nothing builds there.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }
dir=""; pyver=""; lean=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --lean) lean=(--lean) ;;
    --python-version)
      [ $# -ge 2 ] || { echo "gpu_wheels.sh: --python-version needs a value, e.g. 3.12" >&2; exit 2; }
      pyver=$2; shift ;;
    -*) echo "gpu_wheels.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) [ -z "$dir" ] || { echo "gpu_wheels.sh: one directory only ('$dir', then '$1')" >&2; exit 2; }
       dir=$1 ;;
  esac
  shift
done
[ -n "$dir" ] || { echo "gpu_wheels.sh: name the directory to fill (see --help)" >&2; exit 2; }
py=${PYTHON:-python3}
mapfile -t reqs < <("$py" scripts/gpu_wheels.py "${lean[@]}")
target=()
if [ -n "$pyver" ]; then
  target=(--python-version "$pyver" --implementation cp --platform manylinux2014_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
fi
mkdir -p "$dir"
"$py" -m pip download --only-binary=:all: --dest "$dir" "${target[@]}" "${reqs[@]}"
# a dependency that asked for torch (none does today) must not replace the machine's own
rm -f "$dir"/torch-*.whl "$dir"/nvidia_*.whl "$dir"/triton-*.whl
echo "$(ls "$dir"/*.whl | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1)); requirements: ${reqs[*]}"
