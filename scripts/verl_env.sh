#!/usr/bin/env bash
# Builds .venv-verl: verl 0.9.1's agent-loop classes beside rltool, for tests/verl_env/
# and recipes/verl_tool.yaml. verl pins transformers<5.11, omegaconf<2.4 (through
# hydra-core) and antlr4 4.9, so it cannot share rltool's own environment.
#
# The venv sees the system site-packages (torch and the rest of rltool's stack, as
# `pip install torch==2.13.0 -e .` left them) and shadows only what verl needs
# otherwise: transformers 5.10, omegaconf 2.3, antlr4 4.9, huggingface-hub 1.x,
# tensordict 0.10. verl itself goes in without its training-only dependencies
# (wandb, tensorboard, peft, torchdata, pylatexenc, pybind11): the agent-loop
# classes never import them, and pip says so once ("verl requires ..., which is
# not installed"). About 1.5 minutes on 2 cores; a second run is a no-op.
#   bash scripts/verl_env.sh && .venv-verl/bin/python -m pytest tests/verl_env
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VERL_VENV:-.venv-verl}
start=$SECONDS
[ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --no-deps verl==0.9.1
"${pip[@]}" "transformers>=5.5.3,<5.11,!=5.6.0" "tensordict>=0.8.0,<=0.10.0,!=0.9.0" \
  "ray>=2.41.0" hydra-core pillow codetiming fastapi uvicorn cachetools
"${pip[@]}" --no-deps -e .
"$venv/bin/python" -c "import verl.experimental.agent_loop, rltool.agent_loops.verl"
echo "verl environment ready in $venv ($((SECONDS - start)) s)"
