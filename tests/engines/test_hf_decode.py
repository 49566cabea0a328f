"""The lean decode path (``HFEngine(decode="lean")``, rltool/engines/hf_decode.py and, without
routing capture, hf_refill.py) against the reference path (``generate``): the
same greedy tokens, logprobs within 1e-5 and equal to a trainer's recomputation, the same pause
points, routing capture on tiny MoE models. With refill, sampled rows draw only while live, so
under one seed their tokens differ from ``generate``'s once a row has finished: those are
checked by recomputation (tests/engines/test_hf_refill.py: their distribution)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import assert_clear_greedy, reference_logprobs
from tiny_models import random_moe
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import SamplingConfig
from rltool.engines import hf_decode
from rltool.engines.hf import HFEngine
from rltool.moe import find_routers, replaying

SAMPLINGS = [
    SamplingConfig(temperature=0.0, max_new_tokens=9),
    SamplingConfig(temperature=1.0, max_new_tokens=9),
    SamplingConfig(temperature=1.3, top_p=0.9, top_k=20, max_new_tokens=9),
]


@pytest.fixture(scope="module")
def random_model(tokenizer):
    """A tiny Qwen2 with random weights: varied, non-degenerate continuations."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 2, 2, 64)).eval()


def _prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, len(tokenizer), (n,), generator=gen).tolist() for n in lengths]


def _both(model, tokenizer, prompts, sampling, **engine_kwargs):
    """(lean, reference) generations of ``prompts`` under the same seed."""
    out = []
    for decode in ("lean", "reference"):
        engine = HFEngine(model, tokenizer, decode=decode, **engine_kwargs)
        assert (engine._lean is not None) == (decode == "lean")
        torch.manual_seed(11)
        out.append(engine.generate(prompts, sampling))
    return out


def assert_recomputed(model, tokenizer, prompts, gens, sampling) -> None:
    """Sampled generations as a trainer sees them: logprobs equal to a recomputation, "stop"
    exactly for rows that end in EOS (no stop strings here), "length" at the budget."""
    eos = HFEngine(model, tokenizer).eos_ids
    for p, g in zip(prompts, gens, strict=True):
        want, _ = reference_logprobs(model, p, g.token_ids, sampling.temperature or 1.0)
        torch.testing.assert_close(torch.tensor(g.logprobs), want, atol=1e-5, rtol=0)
        assert not set(g.token_ids[:-1]) & set(eos)
        ended = g.token_ids[-1] in eos
        assert g.finish_reason == ("stop" if ended else "length")
        assert ended or len(g.token_ids) == sampling.max_new_tokens


def _assert_same(lean, ref) -> None:
    # Sampled tokens under one seed: the same uniform draws pick from probabilities a few
    # 1e-6 apart, so exact comparison checks that the two paths draw alike.
    assert [g.token_ids for g in lean] == [g.token_ids for g in ref]
    assert [g.finish_reason for g in lean] == [g.finish_reason for g in ref]
    assert [g.model_steps for g in lean] == [g.model_steps for g in ref]
    assert [g.text for g in lean] == [g.text for g in ref]
    torch.testing.assert_close(
        torch.tensor([x for g in lean for x in g.logprobs]),
        torch.tensor([x for g in ref for x in g.logprobs]),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_groups_of_repeated_prompts_match_the_reference(random_model, tokenizer, sampling):
    # groups of 4 over prompts of 7, 4, 6 and 1 tokens (left padding to 7)
    a, b, c, d = _prompts(tokenizer, [7, 4, 6, 1])
    prompts = [a] * 4 + [b] * 4 + [c] * 4 + [d] * 2
    lean, ref = _both(random_model, tokenizer, prompts, sampling)
    if not sampling.temperature:
        assert_clear_greedy(random_model, prompts, ref)
    _assert_same(lean, ref)
    for p, gen in zip(prompts, lean, strict=True):  # what the trainer recomputes
        want, _ = reference_logprobs(random_model, p, gen.token_ids, sampling.temperature or 1.0)
        torch.testing.assert_close(torch.tensor(gen.logprobs), want, atol=1e-5, rtol=0)
    if sampling.temperature > 0:  # repeats are sampled independently
        assert len({tuple(g.token_ids) for g in lean[:4]}) > 1


def test_eos_stop_strings_and_one_token_prompts(random_model, tokenizer):
    """Rows that end (EOS is the pad id here) stay in the batch, masked; a stop string ends a
    row; one-token contexts skip the prefix forward."""
    prompts = _prompts(tokenizer, [1, 1, 1], seed=5)
    lean, ref = _both(random_model, tokenizer, prompts, SamplingConfig(temperature=1.0))
    _assert_same(lean, ref)
    ref_text = ref[0].text
    stop = SamplingConfig(temperature=0.0, max_new_tokens=12, stop=[ref_text[2:4] or "x"])
    lean, ref = _both(random_model, tokenizer, _prompts(tokenizer, [5, 3], seed=7) * 2, stop)
    _assert_same(lean, ref)


def test_greedy_eos_ends_rows_early(tokenizer):
    """A model that says EOS soon: rows finish at different steps, the call stops when all do."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 2, 2, 64)).eval()
    eos = HFEngine(model, tokenizer).eos_ids[0]
    with torch.no_grad():
        model.lm_head.weight[eos] *= 0  # tied: a bias toward EOS through its embedding row
        model.lm_head.weight[eos] += model.model.norm.weight * 0.8
    prompts = _prompts(tokenizer, [4, 6, 5, 3], seed=9) * 2
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=30)
    lean, _ = _both(model, tokenizer, prompts, sampling)
    assert_recomputed(model, tokenizer, prompts, lean, sampling)  # draws differ once rows end
    reasons = [g.finish_reason for g in lean]
    assert "stop" in reasons and "length" in reasons, reasons
    rows: list[int] = []  # the rows of each forward of the lean path
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        torch.manual_seed(11)
        HFEngine(model, tokenizer, decode="lean").generate(prompts, sampling)
    finally:
        hook.remove()
    # one prefix forward over the 4 distinct prompts, then all 8 rows; finished rows leave
    assert rows[:2] == [4, 8] and min(rows) < 4, rows


@pytest.fixture
def per_batch(monkeypatch):
    """The lean loop a batch at a time (rows in step: what routing capture runs), not refill
    (test_hf_refill.py has its pause points)."""
    monkeypatch.setattr(HFEngine, "_refills", lambda _self, _sampling: False)


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.usefixtures("per_batch")
def test_pause_points_take_new_weights_where_the_reference_does(random_model, tokenizer, every):
    """New weights arrive after the first token: both paths stop at the same pause point and
    continue with the new weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        other = Qwen2ForCausalLM(random_model.config).eval().state_dict()
    a, b = _prompts(tokenizer, [6, 4], seed=3)
    results = []
    for decode in ("lean", "reference"):
        m = Qwen2ForCausalLM(random_model.config).eval()
        m.load_state_dict(random_model.state_dict())
        engine = HFEngine(m, tokenizer, decode=decode, chunk_tokens=every, model_step=1)
        waiting = type(engine).weights_waiting

        def load_once(self, engine=engine, waiting=waiting):
            if engine.model_step == 1 and engine._pending is None:
                engine.load_weights(other, 3)
            return waiting.fget(self)

        type(engine).weights_waiting = property(load_once)
        try:
            torch.manual_seed(2)
            results.append(engine.generate([a, a, b], SamplingConfig(max_new_tokens=8)))
        finally:
            type(engine).weights_waiting = waiting
    lean, ref = results
    _assert_same(lean, ref)
    assert lean[0].model_steps[:every] == [1] * every and 3 in lean[0].model_steps


@pytest.mark.usefixtures("per_batch")
def test_pause_points_without_new_weights_keep_one_decode(random_model, tokenizer, monkeypatch):
    calls = []
    decode = hf_decode.LeanDecoder.decode
    monkeypatch.setattr(
        hf_decode.LeanDecoder, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k)
    )
    engine = HFEngine(random_model, tokenizer, decode="lean", chunk_tokens=2)
    engine.generate(_prompts(tokenizer, [5]), SamplingConfig(temperature=0.0, max_new_tokens=6))
    assert len(calls) == 1


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_routing_capture_on_a_tiny_moe(arch, tokenizer):
    """The recorded experts equal those of one unpadded forward of prompt + response (the last
    token, never fed: -1), as on the reference path."""
    model = random_moe(len(tokenizer), arch)
    routers = find_routers(model)
    prompts = [p for p in _prompts(tokenizer, [5, 3], seed=4) for _ in range(3)]
    lean, ref = _both(model, tokenizer, prompts, SamplingConfig(temperature=1.0, max_new_tokens=6))
    _assert_same(lean, ref)
    for p, g, r in zip(prompts, lean, ref, strict=True):
        e = g.routed_experts  # [C + n, L, k]
        assert e.shape == (len(p) + len(g.token_ids), routers.layers, routers.top_k)
        assert (e[-1] == -1).all() and (e[:-1] >= 0).all()
        np.testing.assert_array_equal(e, r.routed_experts)
        with replaying(model, routers, torch.from_numpy(e), replay=False) as seen:
            model(input_ids=torch.tensor([p + g.token_ids]))
        assert not seen.differs[:-1].any()


def test_models_the_lean_loop_cannot_drive_take_the_reference_path(tokenizer):
    config = demo_model_config(tokenizer, 32, 2, 2, 64)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 4, 0
    config.layer_types = ["sliding_attention"] * 2
    assert HFEngine(Qwen2ForCausalLM(config), tokenizer, decode="lean")._lean is None
    with pytest.raises(ValueError, match="decode='fast'"):
        HFEngine(Qwen2ForCausalLM(config), tokenizer, decode="fast")
