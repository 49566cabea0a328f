"""``rltool train`` with ``rollout.engine: vllm``: the gsm8k loop end to end, synchronous
and asynchronous with partial rollouts; the dumped rollouts validate and carry the model
steps of the weights vLLM sampled from.

    bash scripts/vllm_env.sh && .venv-vllm/bin/python -m pytest tests/vllm_env -m slow
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm_env.sh)")

REPO = Path(__file__).resolve().parents[2]
RLTOOL = [sys.executable, "-c", "from rltool.cli.app import main; main()"]


def _train(run_dir: Path, *overrides: str) -> list[list[dict]]:
    """Three steps of recipes/gsm8k_tiny_vllm.yaml; the validated dumps, step by step."""
    train = subprocess.run(
        [*RLTOOL, "train", "recipes/gsm8k_tiny_vllm.yaml", "trainer.steps=3",
         "data.prompts_per_step=8", f"logging.run_dir={run_dir}", *overrides,
         "--dump-rollouts", "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-4000:]
    dumps = sorted(run_dir.glob("gsm8k_tiny_vllm/rollouts/step_*.jsonl"))
    assert len(dumps) == 3, dumps
    validate = subprocess.run(
        [*RLTOOL, "validate-rollouts", *map(str, dumps)], cwd=REPO, capture_output=True, text=True
    )
    assert validate.returncode == 0, validate.stdout[-3000:]
    return [[json.loads(line) for line in d.read_text().splitlines()] for d in dumps]


@pytest.mark.slow
def test_the_vllm_recipe_trains_on_synced_weights(tmp_path):
    """Synchronous: step N samples from the weights after step N-1, so step 3's tokens all
    carry model step 2 (the weights reached vLLM in place)."""
    steps = _train(tmp_path)
    for n, samples in enumerate(steps, start=1):
        assert samples and all(s["status"] == "COMPLETED" for s in samples)
        model_steps = {m for s in samples for m in s["response_model_steps"]}
        assert model_steps == {n - 1}, (n, model_steps)


@pytest.mark.slow
def test_async_production_with_partial_rollouts(tmp_path):
    """Asynchronous, one step ahead, pause points every 4 tokens: every response's model
    steps never decrease and are at most two versions behind the step that trains them."""
    steps = _train(
        tmp_path,
        "produce.mode=async", "produce.max_inflight_steps=1", "rollout.chunk_tokens=4",
        "algorithm.max_token_staleness=1", "algorithm.max_staleness=2",
    )  # fmt: skip
    for n, samples in enumerate(steps, start=1):
        assert samples
        for s in samples:
            ms = s["response_model_steps"]
            assert ms == sorted(ms) and all(n - 3 <= m <= n - 1 for m in ms), (n, ms)
