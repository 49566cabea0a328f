#!/usr/bin/env bash
# Builds .venv-verl: verl 0.9.1's agent-loop classes beside rltool, for tests/verl_env/
# and recipes/verl_tool.yaml. verl pins transformers<5.11, omegaconf<2.4 (through
# hydra-core) and antlr4 4.9, so it cannot share rltool's own environment.
#
# Self-contained: a fresh venv gets the CPU torch, rltool with its dependencies
# (resolved together with verl's pins: transformers 5.10, omegaconf 2.3) and what
# verl's agent-loop modules import (tensordict, hydra-core, fastapi, uvicorn,
# cachetools, datasets, ...). verl itself goes in without its training-only
# dependencies (wandb, tensorboard, peft, torchdata, pylatexenc, pybind11): the
# agent-loop classes never import them. A few minutes on 2 cores; a second run
# only checks.
#   bash scripts/verl_env.sh && .venv-verl/bin/python -m pytest tests/verl_env
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VERL_VENV:-.venv-verl}
start=$SECONDS
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" torch==2.13.0 -e '.[dev]' "transformers>=5.5.3,<5.11,!=5.6.0" \
  "tensordict>=0.8.0,<=0.10.0,!=0.9.0" "ray>=2.41.0" hydra-core pillow codetiming \
  fastapi uvicorn cachetools datasets
"${pip[@]}" --no-deps verl==0.9.1
"$venv/bin/python" -c "import verl.experimental.agent_loop, rltool.agent_loops.verl"
echo "verl environment ready in $venv ($((SECONDS - start)) s)"
