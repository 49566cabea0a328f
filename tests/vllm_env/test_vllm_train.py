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


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_lora_run_syncs_adapters_only(tmp_path, mode):
    """recipes/gsm8k_tiny_lora.yaml's adapters (rank 16 on the 7 projections of 4 layers)
    on vLLM with enable_lora: every sync moves the adapters' bytes, not the 13 MB of merged
    weights, and vLLM's logprobs with the adapter are the trainer's (sync: rollout KL
    ~ 0)."""
    lora = ["model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32"]
    extra = ["produce.mode=async", "produce.max_inflight_steps=1"] if mode == "async" else []
    steps = _train(tmp_path, *lora, "optimizer.lr=1e-3", *extra)
    assert all(s["status"] == "COMPLETED" for samples in steps for s in samples)
    metrics = tmp_path / "gsm8k_tiny_vllm" / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    sent = [x.get("rollout/weight_sync_bytes") for x in train]
    kls = [x["actor/rollout_kl"] for x in train]
    print(f"LoRA on vLLM ({mode}): bytes per step {sent}, rollout KL {kls}")
    # rank 16 x (in + out) summed over q, k, v, o, gate, up, down, 4 layers, fp32
    adapter = 1_249_280
    if mode == "sync":  # a sync after each step: steps 2, 3 carry one each
        assert sent[1:] == [adapter] * (len(sent) - 1)
    else:  # the syncs land in whichever step's batch pops the engine's counters next
        got = [b for b in sent if b is not None]
        assert got and all(b > 0 and b % adapter == 0 for b in got), sent
    if mode == "sync":  # on-policy: vLLM's logprobs with the adapter are the trainer's
        assert max(kls) < 1e-3
