"""A LoRA policy on ``rollout.engine: vllm`` started with ``enable_lora``: syncs move the
adapters only (``rltool.lora_sync``), and what vLLM samples with them is what it samples
with the merged model. Runs only where vLLM is installed (tests/vllm_env/)."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm_env.sh)")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltool.app.demo_model import ensure_demo_checkpoint
from rltool.builtin import resolve_builtin_data
from rltool.config.schema import LoraConfig, ModelConfig, RolloutConfig, SamplingConfig
from rltool.engines.registry import build_engine
from rltool.engines.vllm import VLLMEngine
from rltool.lora import apply_lora, engine_model, merged_copy, rollout_state_dict
from rltool.lora_sync import AdapterPayload, adapter_payload, weights_nbytes
from rltool.metric_names import ROLLOUT_WEIGHT_SYNC_BYTES

N_PROMPTS = 32
LORA = LoraConfig(enabled=True, rank=8, alpha=16)  # every linear layer of the decoder
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=20)


@pytest.fixture(scope="module")
def setup():
    demo = ensure_demo_checkpoint(show_progress=False)
    tokenizer = AutoTokenizer.from_pretrained(demo)
    base = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32)
    policy = apply_lora(base, LORA)
    rows = resolve_builtin_data("builtin:gsm8k_tiny/test.jsonl").read_text().splitlines()
    prompts = []
    for line in rows[:N_PROMPTS]:
        messages = [{"role": "user", "content": json.loads(line)["question"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    # as InProcessBackend builds it in a sync LoRA run: the base model with live adapters
    engine = build_engine(
        RolloutConfig(engine="vllm"),
        ModelConfig(path=str(demo), lora=LORA),
        engine_model(policy),
        tokenizer,
    )
    assert isinstance(engine, VLLMEngine)
    yield policy, tokenizer, prompts, engine
    engine.shutdown()


def _train_steps(policy, tokenizer, prompts, steps: int) -> None:
    """A few AdamW steps on the adapters (next-token loss on the prompts): B moves off 0."""
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(steps):
        for prompt in prompts[:4]:
            ids = torch.tensor([prompt])
            loss = policy(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
    policy.eval()


def _timed_generate(engine, prompts):
    """Greedy outputs and the faster of two runs' seconds (the first warms up)."""
    times, out = [], None
    for _ in range(2):
        t0 = time.perf_counter()
        out = engine.generate(prompts, GREEDY)
        times.append(time.perf_counter() - t0)
    return out, min(times)


def test_syncs_move_adapters_and_greedy_equals_the_merged_model(setup):
    policy, tokenizer, prompts, engine = setup
    assert engine.takes_adapters and engine.max_lora_rank == 8
    engine.pop_metrics()
    base_out = engine.generate(prompts, GREEDY)
    adapter_bytes = []
    for step in (1, 2):
        _train_steps(policy, tokenizer, prompts, 2)
        engine.sync_weights(step)
        adapter_bytes.append(engine.pop_metrics()[ROLLOUT_WEIGHT_SYNC_BYTES])
    payload = adapter_payload(policy)
    assert isinstance(payload, AdapterPayload)
    assert set(engine.llm.llm_engine.list_loras()) == {2}  # a new id per sync, the old removed
    folders = [p for p in engine._dir.iterdir() if p.name.startswith("adapter_")]
    assert folders == [engine._lora_path]  # the first sync's adapter folder is gone

    lora_out, lora_s = _timed_generate(engine, prompts)
    assert all(set(g.model_steps) == {2} for g in lora_out)
    assert [g.token_ids for g in lora_out] != [g.token_ids for g in base_out]  # it trained

    merged = rollout_state_dict(policy)  # what an engine without adapters is sent
    ref = merged_copy(policy).state_dict()  # the merged model (peft's merge_and_unload)
    assert max((ref[k] - v).abs().max().item() for k, v in merged.items()) < 1e-6
    engine.load_weights(merged, 3)  # replaces the base: drops the adapter
    merged_bytes = engine.pop_metrics()[ROLLOUT_WEIGHT_SYNC_BYTES]
    assert not engine.llm.llm_engine.list_loras()
    merged_out, merged_s = _timed_generate(engine, prompts)
    print(
        f"bytes per sync: adapters {adapter_bytes[0]:.0f}, merged {merged_bytes:.0f} "
        f"({merged_bytes / adapter_bytes[0]:.1f}x); greedy {N_PROMPTS} prompts: "
        f"adapter {lora_s:.2f} s, merged {merged_s:.2f} s ({lora_s / merged_s:.2f}x)"
    )
    assert [g.token_ids for g in lora_out] == [g.token_ids for g in merged_out]
    pairs = zip(lora_out, merged_out, strict=True)
    lp = [abs(a - b) for x, y in pairs for a, b in zip(x.logprobs, y.logprobs, strict=True)]
    assert max(lp) < 1e-3
    # the bytes: the adapters' tensors (rank 8 on 7 projections x layers), a fraction of
    # the full weights; the merged state dict's bytes are every weight once
    assert adapter_bytes == [weights_nbytes(payload)] * 2
    assert merged_bytes == weights_nbytes(merged)
    assert adapter_bytes[0] * 5 < merged_bytes
