"""The HF engine handed a shared LoRA policy (sync, in process: the peft model's base model,
adapters inside) generates on a plain merged copy: no peft layer in its forward path, the
merged weights copied in at each ``sync_weights``, greedy tokens equal to the merged model's
after a training step, the trainer's model untouched (docs/lora.md)."""

from __future__ import annotations

import copy

import torch
from hf_reference import assert_clear_greedy, reference_logprobs
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import LoraConfig, SamplingConfig
from rltool.engines.hf import HFEngine
from rltool.lora import apply_lora, engine_model, has_lora_layers, merged_copy

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8)


def _policy(tokenizer) -> torch.nn.Module:
    """A tiny random Qwen2 (weights drawn wider than the init's: varied greedy text) with
    fresh rank-4 adapters on every linear projection (B = 0)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 2, 2, 64))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3)
        return apply_lora(model, LoraConfig(rank=4, alpha=8, dropout=0.1))


def _train_step(policy: torch.nn.Module, tokenizer) -> None:
    """One AdamW step on random next-token targets: every adapter B moves away from 0."""
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.05)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(10, len(tokenizer), (4, 12), generator=gen)
    policy.train()
    loss = policy(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _prompts(tokenizer, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, len(tokenizer), (3 + i,), generator=gen).tolist() for i in range(n)]


def test_shared_lora_policy_generates_on_a_plain_merged_copy(tokenizer):
    policy = _policy(tokenizer)
    shared = engine_model(policy)  # what the in-process backend hands a sync engine
    engine = HFEngine(shared, tokenizer, batch_size=4, slots=4)
    assert has_lora_layers(shared) and not has_lora_layers(engine.model)
    peft_modules = [
        type(m).__name__ for m in engine.model.modules() if "peft" in type(m).__module__
    ]
    assert peft_modules == []
    assert engine._lean is not None  # the lean decoder drives the copy
    assert ".lora_" not in " ".join(engine.model.state_dict())  # base names
    before = {k: v.clone() for k, v in policy.state_dict().items()}

    _train_step(policy, tokenizer)
    trained = {k: v.clone() for k, v in policy.state_dict().items()}
    assert any(not torch.equal(before[k], trained[k]) for k in before if "lora_B" in k)
    prompts = _prompts(tokenizer, 6)
    stale = engine.generate(prompts, GREEDY)  # the step-0 weights until the sync
    engine.sync_weights(1)
    assert engine.model_step == 1

    calls = []  # a forward through any of the policy's LoRA layers
    hooks = [
        m.register_forward_hook(lambda *_: calls.append(1))
        for m in policy.modules()
        if "peft.tuners" in type(m).__module__
    ]
    try:
        got = engine.generate(prompts, GREEDY)
    finally:
        for h in hooks:
            h.remove()
    assert calls == []  # generation never ran the trainer's peft layers

    merged = merged_copy(policy).eval()
    assert_clear_greedy(merged, prompts, got)  # no near-tie: exact comparison is fair
    want = HFEngine(merged, tokenizer, batch_size=4, slots=4).generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.token_ids for g in got] != [g.token_ids for g in stale]  # the step mattered
    assert all(g.model_steps == [1] * len(g.token_ids) for g in got)
    for p, g in zip(prompts, got, strict=True):  # logprobs of the policy itself, peft's forward
        lp, _ = reference_logprobs(policy.eval(), p, g.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(g.logprobs), lp, atol=1e-5, rtol=0)
    after = policy.state_dict()
    assert all(torch.equal(trained[k], after[k]) for k in trained)  # the trainer's model as is


def test_sync_during_a_generate_waits_for_the_pause_point(tokenizer):
    """A sync while a generate runs (the trainer updating meanwhile) is a snapshot applied at
    the next pause point, as ``load_weights`` does: the copy never changes under a forward."""
    policy = _policy(tokenizer)
    engine = HFEngine(engine_model(policy), tokenizer, chunk_tokens=2)
    _train_step(policy, tokenizer)
    snapshot = copy.deepcopy(engine.model.state_dict())
    with engine._generating_now():
        engine.sync_weights(1)
        assert engine.weights_waiting and engine.model_step == 0
        now = engine.model.state_dict()
        assert all(torch.equal(snapshot[k], now[k]) for k in snapshot)
    assert not engine.weights_waiting and engine.model_step == 1
    merged = merged_copy(policy).state_dict()
    for name, value in engine.model.state_dict().items():
        torch.testing.assert_close(value, merged[name], atol=1e-6, rtol=0)
