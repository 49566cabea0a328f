#!/usr/bin/env bash
# Builds .venv-envs: the environment ecosystems rltool trains on (docs/environments.md):
# verifiers 0.4.0, OpenEnv (openenv-core 0.3.0), reasoning-gym 0.1.25 and MCP, beside rltool,
# for tests/envs_env/ and recipes/{verifiers,openenv,reasoning_gym,mcp}_*.yaml.
# verifiers pins mcp==2.0.0, so these cannot share one environment with mcp 2.3; the four
# resolve together here (shared/design/facts.md). Each is also an extra of rltool's own
# (`pip install 'rltool[reasoning-gym]'`) for a user who needs just one.
#
# Self-contained: a fresh venv gets the CPU torch and rltool with these extras, resolved
# together. About 3 minutes on 2 cores; a second run only checks.
#   bash scripts/envs_env.sh && .venv-envs/bin/python -m pytest tests/envs_env
# ENVS_VENV=DIR builds it elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${ENVS_VENV:-.venv-envs}
start=$SECONDS
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0 -e '.[dev,environments]'
"$venv/bin/python" -c "import verifiers, openenv, reasoning_gym, mcp; print('environments ok')"
# the example verifiers environment of recipes/verifiers_arith.yaml
"$venv/bin/python" -m pip install -q --no-deps -e recipes/envs/vf_arith
# verifiers' chat program (run through uv per rollout): locked and installed now, so a
# training run needs no network (rltool/agent_loops/verifiers_env.py: lock_chat_program)
PATH="$PWD/$venv/bin:$PATH" "$venv/bin/python" -m rltool.agent_loops.verifiers_env
echo "Environments ready in $venv ($((SECONDS - start)) s)"
