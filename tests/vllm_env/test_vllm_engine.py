"""``rollout.engine: vllm`` against the HF engine and the trainer, on the demo checkpoint.

Runs only where vLLM is installed (it pins its own torch and transformers):

    bash scripts/vllm_env.sh && .venv-vllm/bin/python -m pytest tests/vllm_env

One ``LLM`` for the module (vLLM takes ~1 min to start on 2 cores); the tests that change
its weights come last (the LoRA one last of all).
"""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm_env.sh)")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltool.agent_loops.base import LoopContext
from rltool.agent_loops.localhost import LocalhostLoop
from rltool.app.demo_model import ensure_demo_checkpoint
from rltool.builtin import resolve_builtin_data
from rltool.config.schema import LoraConfig, ModelConfig, RolloutConfig, SamplingConfig
from rltool.engines.hf import HFEngine
from rltool.engines.registry import build_engine
from rltool.engines.vllm import VLLMEngine
from rltool.lora import apply_lora, engine_model, merged_copy
from rltool.rollout.contract import check_group, errors
from rltool.rollout.state import IGNORE_INDEX, Status
from rltool.training.logprobs import token_logprobs

N_PROMPTS = 64


@pytest.fixture(scope="module")
def demo_dir():
    return ensure_demo_checkpoint(show_progress=False)


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return AutoTokenizer.from_pretrained(demo_dir)


@pytest.fixture(scope="module")
def model(demo_dir):
    return AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    path = resolve_builtin_data("builtin:gsm8k_tiny/test.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()[:N_PROMPTS]]
    out = []
    for row in rows:
        messages = [{"role": "user", "content": row["question"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert len(out) == N_PROMPTS
    return out


@pytest.fixture(scope="module")
def engine(demo_dir, model, tokenizer):
    rollout = RolloutConfig(engine="vllm")
    eng = build_engine(rollout, ModelConfig(path=str(demo_dir)), model, tokenizer)
    assert isinstance(eng, VLLMEngine)
    yield eng
    eng.shutdown()


GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=20)


def _trainer_logprobs(model, prompt, response, temperature):
    """The trainer's recomputation: one forward over prompt+response, the one shift,
    ``token_logprobs`` at the sampling temperature (1 for greedy)."""
    ids = torch.tensor([*prompt, *response])  # [P+R]
    labels = torch.tensor([IGNORE_INDEX] * len(prompt) + list(response))  # [P+R]
    with torch.no_grad():
        logits = model(input_ids=ids[None, :-1], use_cache=False).logits[0]  # [P+R-1, V]
        logp, _ = token_logprobs(logits, labels[1:], temperature or 1.0)  # [P+R-1]
    return logp[len(prompt) - 1 :]  # [R]


def test_greedy_tokens_equal_the_hf_engines(engine, model, tokenizer, prompts):
    ours = engine.generate(prompts, GREEDY)
    ref = HFEngine(model, tokenizer).generate(prompts, GREEDY)
    assert [g.token_ids for g in ours] == [g.token_ids for g in ref]
    assert [g.finish_reason for g in ours] == [g.finish_reason for g in ref]
    assert [g.text for g in ours] == [g.text for g in ref]
    assert all(g.model_steps == [0] * len(g.token_ids) for g in ours)
    diffs = [
        (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
        for a, b in zip(ours, ref, strict=True)
    ]
    assert max(diffs) < 1e-4


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_logprobs_are_the_trainers(engine, model, prompts, temperature, top_p):
    """Four samples of each of 16 prompts (the group shares its prompt's prefix): the
    engine's logprobs are what the trainer recomputes, so the importance ratio at step 0
    is 1."""
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=20)
    group = [p for p in prompts[:16] for _ in range(4)]
    gens = engine.generate(group, sampling)
    diffs = []
    for prompt, g in zip(group, gens, strict=True):
        assert len(g.token_ids) == len(g.logprobs) == len(g.model_steps) > 0
        recomputed = _trainer_logprobs(model, prompt, g.token_ids, temperature)
        diffs.append((torch.tensor(g.logprobs) - recomputed).abs())
    mean_abs = torch.cat(diffs).mean().item()
    print(f"T={temperature} top_p={top_p}: mean |engine - trainer| = {mean_abs:.2e}")
    assert mean_abs < 1e-3
    # samples of one prompt differ: n samples, not one sample copied
    assert len({tuple(g.token_ids) for g in gens[:4]}) > 1


def test_stop_strings_and_length_end_a_row_as_in_the_hf_engine(engine, model, tokenizer, prompts):
    for sampling in (
        SamplingConfig(temperature=0.0, max_new_tokens=20, stop=["####"]),
        SamplingConfig(temperature=0.0, max_new_tokens=3),
    ):
        ours = engine.generate(prompts[:8], sampling)
        ref = HFEngine(model, tokenizer).generate(prompts[:8], sampling)
        assert [(g.token_ids, g.finish_reason) for g in ours] == [
            (g.token_ids, g.finish_reason) for g in ref
        ]


def test_partial_rollouts_in_chunks_equal_one_call(engine, model, tokenizer, prompts):
    """Pause points every 3 tokens (rollout.chunk_tokens): greedy output unchanged."""
    whole = engine.generate(prompts[:8], GREEDY)
    engine.chunk_tokens = 3
    try:
        chunked = engine.generate(prompts[:8], GREEDY)
        stop = SamplingConfig(temperature=0.0, max_new_tokens=20, stop=["####"])
        chunked_stop = engine.generate(prompts[:8], stop)
    finally:
        engine.chunk_tokens = None
    assert [g.token_ids for g in chunked] == [g.token_ids for g in whole]
    assert [g.finish_reason for g in chunked] == [g.finish_reason for g in whole]
    ref_stop = HFEngine(model, tokenizer).generate(prompts[:8], stop)
    assert [g.token_ids for g in chunked_stop] == [g.token_ids for g in ref_stop]


def short_agent(client, task):
    """One chat turn without tools: the calculator agent's tool prompt (536 tokens) is past
    the demo model's context (512), which vLLM refuses where transformers runs on."""
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["question"]}], max_tokens=8
    )
    return reply.choices[0].message.content


def test_localhost_sessions_through_the_session_server(engine, tokenizer):
    """The localhost loop: an agent's chat calls reach vLLM through the session server and
    the batcher's engine-caller thread; the recorded sessions pass the contract."""
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=8), task_name="localhost")
    loop = LocalhostLoop(
        ctx, agent="test_vllm_engine:short_agent", judger="rltool.agents.calculator:judge"
    )
    task = {"question": "Tom has 7 apples and buys 5 more. How many?", "answer": "#### 12"}
    (group,) = loop.generate_groups([task], 2, ["a"])
    states = list(group)
    assert all(s.status == Status.COMPLETED for s in states), [s.error for s in states]
    assert errors(check_group(group)) == []
    assert {s.session_id for s in states} == {"a.0", "a.1"}
    assert all(set(s.response_model_steps) == {0} for s in states)


def _train_one_step(model, tokenizer, prompts):
    """One SGD step on the NLL of a fixed answer: enough to change greedy outputs."""
    target = tokenizer("#### 7", add_special_tokens=False)["input_ids"]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    for prompt in prompts[:8]:
        ids = torch.tensor([[*prompt, *target]])
        labels = torch.tensor([[IGNORE_INDEX] * len(prompt) + target])
        model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


def test_load_weights_then_greedy_equals_hf_on_the_new_weights(engine, model, tokenizer, prompts):
    before = engine.generate(prompts, GREEDY)
    trained = copy.deepcopy(model)
    _train_one_step(trained, tokenizer, prompts)
    engine.load_weights(trained.state_dict(), model_step=1)
    assert engine.model_step == 1 and not engine.weights_waiting
    after = engine.generate(prompts, GREEDY)
    ref = HFEngine(trained, tokenizer).generate(prompts, GREEDY)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]  # the step mattered
    assert [g.token_ids for g in after] == [g.token_ids for g in ref]
    assert all(set(g.model_steps) == {1} for g in after)
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=20)
    gens = engine.generate(prompts[:16], sampling)
    diffs = [
        (torch.tensor(g.logprobs) - _trainer_logprobs(trained, p, g.token_ids, 0.7)).abs()
        for p, g in zip(prompts[:16], gens, strict=True)
    ]
    assert torch.cat(diffs).mean().item() < 1e-3
    with pytest.raises(ValueError, match=r"load_weights\(0\) goes back from step 1"):
        engine.load_weights(trained.state_dict(), model_step=0)


def test_sync_weights_pushes_the_trainers_model(engine, model, tokenizer, prompts):
    """The shared-model path: vLLM holds its own copy, so sync_weights copies the weights of
    the model the engine was built with (the trainer's), trained in place here."""
    before = engine.generate(prompts, GREEDY)
    _train_one_step(model, tokenizer, prompts[8:])
    engine.sync_weights(2)
    after = engine.generate(prompts, GREEDY)
    ref = HFEngine(model, tokenizer).generate(prompts, GREEDY)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    assert [g.token_ids for g in after] == [g.token_ids for g in ref]
    assert all(set(g.model_steps) == {2} for g in after)


def test_sync_weights_of_a_lora_policy_loads_the_merged_weights(engine, model, tokenizer, prompts):
    """A LoRA run in process: the engine holds the peft model's base model (adapters
    inside); ``sync_weights`` sends W + scale * B @ A under the base model's names, which
    vLLM's reload takes; greedy then equals the HF engine on the merged model."""
    lora = LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])
    policy = apply_lora(copy.deepcopy(model), lora)
    torch.manual_seed(5)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # B != 0: the adapters change the outputs
    merged = merged_copy(policy).eval()
    before = engine.generate(prompts, GREEDY)
    trainers = engine.model
    engine.model = engine_model(policy)  # as InProcessBackend hands it in a sync LoRA run
    try:
        engine.sync_weights(3)
    finally:
        engine.model = trainers
    after = engine.generate(prompts, GREEDY)
    ref = HFEngine(merged, tokenizer).generate(prompts, GREEDY)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]  # the adapters mattered
    assert [g.token_ids for g in after] == [g.token_ids for g in ref]
    assert all(set(g.model_steps) == {3} for g in after)
