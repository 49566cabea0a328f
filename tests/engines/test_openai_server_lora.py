"""A LoRA run on the openai_server engine: syncs load the adapters through vLLM's
``/v1/load_lora_adapter`` (the fixture server of completions_fixture.py: peft reads the
folder), requests name the adapter, the bytes per sync are the adapter's. The real
``vllm serve``: tests/vllm_env/test_vllm_server_lora.py."""

from __future__ import annotations

import copy

import pytest
import torch
from completions_fixture import FixtureCompletionsServer
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import LoraConfig, SamplingConfig
from rltool.engines.hf import HFEngine
from rltool.engines.openai_pool import ServerPool
from rltool.engines.openai_server import OpenAIServerEngine, vllm_serve_args
from rltool.lora import apply_lora, engine_model, merged_copy, rollout_state_dict
from rltool.lora_sync import adapter_payload, weights_nbytes
from rltool.metric_names import ROLLOUT_WEIGHT_SYNC_BYTES

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 1, 2, 64)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)  # wider than the init: the greedy text varies
    return model


def _policy(model, seed: int) -> torch.nn.Module:
    policy = apply_lora(copy.deepcopy(model), LoraConfig(rank=4, alpha=8))
    torch.manual_seed(seed)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # B != 0: the adapters change the outputs
    return policy.eval()


def test_syncs_load_adapters_that_requests_name(model, tokenizer, tmp_path):
    servers = [FixtureCompletionsServer(copy.deepcopy(model), tokenizer) for _ in range(2)]
    policy = _policy(model, 3)
    pool = ServerPool([s.url for s in servers], timeout_s=30)
    engine = OpenAIServerEngine(
        pool,
        tokenizer,
        "tiny",
        weights_dir=str(tmp_path),
        model=engine_model(policy),
        takes_adapters=True,
    )
    prompts = [tokenizer.encode(f"Q: what is {i} plus {2 * i}? A:") for i in range(4)]
    try:
        engine.pop_metrics()
        engine.sync_weights(1)
        assert engine.pop_metrics()[ROLLOUT_WEIGHT_SYNC_BYTES] == weights_nbytes(
            adapter_payload(policy)
        )
        assert all(s.weights == [] for s in servers)  # no full weights went
        (name,) = servers[0].adapters
        got = engine.generate(prompts, GREEDY)
        want = HFEngine(merged_copy(policy), tokenizer).generate(prompts, GREEDY)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert all(g.model_steps == [1] * len(g.token_ids) for g in got)
        assert {r["model"] for s in servers for r in s.requests} == {name}
        # the next sync: a new name (a server caches adapters by name), the old unloaded
        for p in policy.parameters():
            if p.requires_grad:
                p.data.mul_(-1.0)
        engine.sync_weights(2)
        assert all(list(s.adapters) != [name] and len(s.adapters) == 1 for s in servers)
        assert [p.name for p in tmp_path.iterdir()] == [engine._written[0].name]  # old gone
        got = engine.generate(prompts, GREEDY)
        want = HFEngine(merged_copy(policy), tokenizer).generate(prompts, GREEDY)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        # merged weights replace the base: the adapter is unloaded, the base name served
        engine.load_weights(rollout_state_dict(policy), 3)
        assert all(s.adapters == {} for s in servers)
        merged_bytes = engine.pop_metrics()[ROLLOUT_WEIGHT_SYNC_BYTES]
        assert merged_bytes > weights_nbytes(adapter_payload(policy))
        engine.generate(prompts[:1], GREEDY)
        assert servers[0].requests[-1]["model"] == "tiny"
    finally:
        engine.shutdown()
        for s in servers:
            s.kill()


def test_a_server_without_lora_says_what_to_start_it_with(model, tokenizer, tmp_path):
    server = FixtureCompletionsServer(copy.deepcopy(model), tokenizer)
    server.route = lambda path, body: (404, {"error": f"no route {path}"})  # no LoRA
    engine = OpenAIServerEngine(
        ServerPool([server.url], timeout_s=30),
        tokenizer,
        "tiny",
        weights_dir=str(tmp_path),
        model=engine_model(_policy(model, 1)),
        takes_adapters=True,
    )
    try:
        with pytest.raises(RuntimeError, match=r"--enable-lora --max-lora-rank.*RUNTIME_LORA"):
            engine.sync_weights(1)
    finally:
        engine.shutdown()
        server.kill()


def test_vllm_serve_args_of_a_lora_run():
    args = vllm_serve_args("/m", "127.0.0.1", 8000, "demo", lora_rank=4)
    at = args.index("--max-lora-rank")
    assert "--enable-lora" in args and args[at + 1] == "8"  # vLLM's smallest rank >= 4
    assert "--enable-lora" not in vllm_serve_args("/m", "127.0.0.1", 8000, "demo")
