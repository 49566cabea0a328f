"""The lean loop with refill (rltool/engines/hf_refill.py): more prompts than ``batch_size``,
rows that end at different steps, finished slots taken by the next prompts. Greedy tokens equal
the reference path's, sampled ones are drawn from the model's filtered distribution, new weights
wait until the live rows end or, with ``chunk_tokens``, until the next pause point."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from hf_reference import assert_clear_greedy, reference_logprobs
from test_hf_decode import _prompts, assert_recomputed
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import SamplingConfig
from rltool.engines import hf_refill
from rltool.engines.hf import HFEngine
from rltool.engines.hf_decode import _filter_logits


@pytest.fixture(autouse=True, params=["shared prompts", "own prompts"])
def layout(request, monkeypatch):
    """Every test runs on both layouts of the refill loop (the engine picks one by size)."""
    shared = request.param == "shared prompts"
    monkeypatch.setattr(hf_refill, "shares_prompts", lambda _prompts, _slots: shared)
    return shared


@pytest.fixture(scope="module")
def eos_model(tokenizer):
    """A tiny random Qwen2 biased toward EOS: rows end at different steps."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 2, 2, 64)).eval()
    eos = HFEngine(model, tokenizer).eos_ids[0]
    with torch.no_grad():
        model.lm_head.weight[eos] *= 0  # tied: a bias toward EOS through its embedding row
        model.lm_head.weight[eos] += model.model.norm.weight * 0.8
    return model


def _forward_rows(model, run) -> list[int]:
    rows: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        run()
    finally:
        hook.remove()
    return rows


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_refilled_slots_keep_the_reference_tokens_and_logprobs(eos_model, tokenizer, temperature):
    # groups of 2 over prompts of 4..8 tokens, 3 slots: prompts start while others decode
    prompts = [p for p in _prompts(tokenizer, [4, 8, 5, 3, 7, 6], seed=9) for _ in range(2)]
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=12)
    engine = HFEngine(eos_model, tokenizer, batch_size=3, slots=3)
    assert engine._refills(sampling)
    torch.manual_seed(4)
    lean: list = []
    rows = _forward_rows(eos_model, lambda: lean.extend(engine.generate(prompts, sampling)))
    assert_recomputed(eos_model, tokenizer, prompts, lean, sampling)
    lengths = {len(g.token_ids) for g in lean}
    assert len(lengths) >= 2, lengths  # rows end at different steps
    # decode forwards have at most 3 rows; prefills come between decode steps
    assert max(rows) <= 3 and rows.count(1) + rows.count(2) > 0
    if not temperature:
        ref = HFEngine(eos_model, tokenizer, decode="reference").generate(prompts, sampling)
        assert_clear_greedy(eos_model, prompts, ref)
        assert [g.token_ids for g in lean] == [g.token_ids for g in ref]
        assert [g.finish_reason for g in lean] == [g.finish_reason for g in ref]
        got = torch.tensor([x for g in lean for x in g.logprobs])
        want = torch.tensor([x for g in ref for x in g.logprobs])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_sampled_first_tokens_follow_each_prompts_filtered_distribution(eos_model, tokenizer):
    """Two prompts interleaved over 8 slots, rows of 1-2 tokens: each prompt's first tokens
    have the frequencies of its own top-k/top-p distribution (a row mix-up would not)."""
    a, b = _prompts(tokenizer, [6, 3], seed=2)
    sampling = SamplingConfig(temperature=1.3, top_k=4, top_p=0.95, max_new_tokens=2)
    n = 600
    torch.manual_seed(0)
    gens = HFEngine(eos_model, tokenizer, batch_size=8, slots=8).generate([a, b] * n, sampling)
    assert {len(g.token_ids) for g in gens} == {1, 2}  # some rows end early: slots refill
    vocab = eos_model.config.vocab_size
    for k, prompt in enumerate((a, b)):
        with torch.no_grad():
            logits = eos_model(input_ids=torch.tensor([prompt])).logits[0, -1]  # [V]
        scores = _filter_logits(logits[None] / sampling.temperature, 4, 0.95)
        want = scores.softmax(-1)[0]  # [V]
        firsts = torch.tensor([g.token_ids[0] for g in gens[k::2]])
        seen = torch.bincount(firsts, minlength=vocab).float() / n  # [V]
        assert seen[want == 0].sum() == 0
        # std of a frequency <= 0.5 / sqrt(600) ~ 0.02
        torch.testing.assert_close(seen, want, atol=0.07, rtol=0)


def test_weights_handed_over_mid_call_wait_for_the_live_rows(eos_model, tokenizer):
    """Weights arrive while the first slots decode: no further prompt starts, the live rows
    end on the old weights, the rest run on the new ones (greedy: the new model's tokens)."""
    model = Qwen2ForCausalLM(eos_model.config).eval()
    model.load_state_dict(eos_model.state_dict())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        other = Qwen2ForCausalLM(eos_model.config).eval()
    prompts = _prompts(tokenizer, [4, 8, 5, 3, 7, 6], seed=9)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=6)
    engine = HFEngine(model, tokenizer, batch_size=2, slots=2, model_step=1)
    waiting, calls = type(engine).weights_waiting, []

    def load_on_third_look(self, waiting=waiting):
        calls.append(1)
        if len(calls) == 3:
            engine.load_weights(other.state_dict(), 3)
        return waiting.fget(self)

    type(engine).weights_waiting = property(load_on_third_look)
    try:
        gens = engine.generate(prompts, sampling)
    finally:
        type(engine).weights_waiting = waiting
    steps = [set(g.model_steps) for g in gens]
    assert steps[0] == {1} and steps[-1] == {3}, steps
    assert all(len(s) == 1 for s in steps)  # no row mixes weights
    cut = steps.index({3})
    assert all(s == {3} for s in steps[cut:])
    ref = HFEngine(other, tokenizer, decode="reference").generate(prompts[cut:], sampling)
    assert [g.token_ids for g in gens[cut:]] == [g.token_ids for g in ref]


@contextmanager
def _handed_over_at_forward(engine, model, n: int, weights):
    """``weights`` (step 3) reach ``engine`` as ``model``'s ``n``-th forward starts, as a
    trainer's sync would reach a generate in flight."""
    forwards: list[int] = []

    def hook(_module, _args):
        forwards.append(1)
        if len(forwards) == n:
            engine.load_weights(weights, 3)

    handle = model.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _assert_own_models(prompts, gens, models, temperature) -> list[int]:
    """Each row's tokens: those of step 1 then those of step 3, each part's logprobs its own
    model's (greedy: its argmax), the second part continuing from prompt + the first. Returns
    each row's count of step-1 tokens."""
    old, new = models
    splits = []
    for p, g in zip(prompts, gens, strict=True):
        j = g.model_steps.count(1)
        assert g.model_steps == [1] * j + [3] * (len(g.token_ids) - j), g.model_steps
        splits.append(j)
        parts = [(old, p, g.token_ids[:j], g.logprobs[:j])]
        parts.append((new, p + g.token_ids[:j], g.token_ids[j:], g.logprobs[j:]))
        for m, context, tokens, lps in parts:
            if not tokens:
                continue
            want, argmax = reference_logprobs(m, context, tokens, temperature or 1.0)
            torch.testing.assert_close(torch.tensor(lps), want, atol=1e-5, rtol=0)
            if not temperature:
                assert_clear_greedy(m, [context], [SimpleNamespace(token_ids=tokens)])
                assert tokens == argmax.tolist()
    return splits


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pause_points_hand_the_live_rows_to_new_weights(eos_model, tokenizer, every, temperature):
    """With ``chunk_tokens``, weights handed over mid-call stop the loop at the next pause
    point: the live rows go on from prompt + tokens so far on the new weights, and no prompt
    starts on the old ones after."""
    model = Qwen2ForCausalLM(eos_model.config).eval()
    model.load_state_dict(eos_model.state_dict())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        other = Qwen2ForCausalLM(eos_model.config).eval()
    prompts = _prompts(tokenizer, [4, 8, 5, 3, 7, 6, 5, 4], seed=9)
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=8)
    engine = HFEngine(model, tokenizer, batch_size=3, slots=3, chunk_tokens=every, model_step=1)
    assert engine._refills(sampling)
    torch.manual_seed(4)
    # forward 4 comes after the first prefill and at most 3 decode steps: the pause point is
    # the first multiple of `every` from step 3 on
    with _handed_over_at_forward(engine, model, 4, other.state_dict()):
        gens = engine.generate(prompts, sampling)
    splits = _assert_own_models(prompts, gens, (eos_model, other), temperature)
    cut = next(i for i, j in enumerate(splits) if j == 0)
    assert not any(splits[cut:]), splits  # no prompt starts on the old weights after
    assert any(0 < j < len(g.token_ids) for j, g in zip(splits, gens, strict=True)), splits
    assert max(splits) <= -(-3 // every) * every, splits


def test_pause_points_without_new_weights_keep_one_loop(eos_model, tokenizer, monkeypatch):
    calls = []
    loop = hf_refill.decode_refilling
    monkeypatch.setattr(hf_refill, "decode_refilling", lambda *a: calls.append(1) or loop(*a))
    engine = HFEngine(eos_model, tokenizer, batch_size=2, slots=2, chunk_tokens=1)
    prompts = _prompts(tokenizer, [5, 3, 4], seed=2)
    gens = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=6))
    assert len(calls) == 1
    ref = HFEngine(eos_model, tokenizer, decode="reference").generate(
        prompts, SamplingConfig(temperature=0.0, max_new_tokens=6)
    )
    assert [g.token_ids for g in gens] == [g.token_ids for g in ref]


@pytest.mark.parametrize(
    ("free_rows", "slots", "batch_size", "want"),
    [(5.5, 8, 2, 5), (100, 8, 2, 8), (0.5, 8, 2, 2), (100, 2, 4, 4)],
)
def test_slots_shrink_to_the_free_memory_but_not_below_a_batch(
    eos_model, tokenizer, monkeypatch, free_rows, slots, batch_size, want
):
    """``slots`` rows, fewer where their KV cache (every row holding its whole context) and
    vocabulary rows would take more than ``cache_memory`` of the free memory, never fewer
    than ``batch_size``."""
    prompts = _prompts(tokenizer, [4, 8, 5, 3, 7, 6, 4, 5, 6, 7, 3, 8], seed=9)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=12)
    cfg = eos_model.config  # 2 layers, 2 key/value heads of 32 / 2, float32
    # keys and values of 8 - 1 + 12 columns, 4 float32 vocabulary rows
    row_bytes = 2 * 2 * 2 * 16 * (8 - 1 + 12) * 4 + 4 * 4 * cfg.vocab_size
    monkeypatch.setattr(hf_refill, "free_memory", lambda _d: int(4 * free_rows * row_bytes))
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size) == (2, 2, 32)
    engine = HFEngine(eos_model, tokenizer, batch_size=batch_size, slots=slots, cache_memory=0.25)
    assert hf_refill.fitting_slots(engine._lean, prompts, 12, engine) == want
    rows = _forward_rows(eos_model, lambda: engine.generate(prompts, sampling))
    assert max(rows) == want  # the first decode step fills every slot
