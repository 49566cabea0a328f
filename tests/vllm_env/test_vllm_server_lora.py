"""A LoRA policy on ``rollout.engine: openai_server`` against a real ``vllm serve`` started
with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: syncs load the
adapters through ``/v1/load_lora_adapter``, requests name them, greedy equals the merged
model's. Runs only where vLLM is installed (tests/vllm_env/)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm_env.sh)")

import httpx
import torch
from transformers import AutoModelForCausalLM

from rltool.config.schema import LoraConfig, ModelConfig, RolloutConfig
from rltool.engines.hf import HFEngine
from rltool.engines.openai_server import OpenAIServerEngine, vllm_serve_args
from rltool.engines.registry import build_engine
from rltool.lora import apply_lora, engine_model, merged_copy
from rltool.lora_sync import adapter_payload, weights_nbytes
from rltool.metric_names import ROLLOUT_WEIGHT_SYNC_BYTES
from tests.vllm_env.test_vllm_engine import GREEDY, demo_dir, prompts, tokenizer  # noqa: F401
from tests.vllm_env.test_vllm_server import REPO, SERVE, _free_port, vllm_served

SERVED = "demo"
LORA = LoraConfig(enabled=True, rank=8, alpha=16, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def lora_server(demo_dir, tmp_path_factory):  # noqa: F811
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-serve-lora") / "serve.log"
    args = vllm_serve_args(str(demo_dir), "127.0.0.1", port, SERVED, lora_rank=LORA.rank)
    command = [*SERVE, *args, "--enforce-eager", "--gpu-memory-utilization", "0.1"]
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "PYTHONPATH": str(REPO),
    }
    with vllm_served(command, env, log) as url:
        yield url


def test_syncs_load_adapters_and_greedy_equals_the_merged_model(
    lora_server,
    demo_dir,  # noqa: F811
    tokenizer,  # noqa: F811
    prompts,  # noqa: F811
    tmp_path,
):
    base = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    policy = apply_lora(base, LORA)
    rollout = RolloutConfig(engine="openai_server", servers=[lora_server])
    rollout.server.model = SERVED
    rollout.server.weights_dir = str(tmp_path)
    model_cfg = ModelConfig(path=str(demo_dir), lora=LORA)
    engine = build_engine(rollout, model_cfg, engine_model(policy), tokenizer)
    assert isinstance(engine, OpenAIServerEngine) and engine.takes_adapters
    try:
        before = engine.generate(prompts, GREEDY)
        for step in (1, 2):  # two syncs: the second replaces the first adapter
            torch.manual_seed(step)
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.1)
            engine.pop_metrics()
            engine.sync_weights(step)
            sent = engine.pop_metrics()[ROLLOUT_WEIGHT_SYNC_BYTES]
            assert sent == weights_nbytes(adapter_payload(policy))
        models = httpx.get(f"{lora_server}/models").json()["data"]
        assert sorted(m["id"] for m in models) == sorted([SERVED, engine._adapter])
        after = engine.generate(prompts, GREEDY)
        ref = HFEngine(merged_copy(policy).eval(), tokenizer).generate(prompts, GREEDY)
        print(f"openai_server LoRA: {sent:.0f} bytes per sync")
        assert [g.token_ids for g in after] != [g.token_ids for g in before]
        assert [g.token_ids for g in after] == [g.token_ids for g in ref]
        assert all(set(g.model_steps) == {2} for g in after)
    finally:
        engine.shutdown()
