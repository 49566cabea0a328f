"""Shared prefill of repeated contexts (``rltool.engines.hf_prefill``) through HFEngine:
the same tokens, logprobs and steps as the unshared path, with one prefix forward per
distinct context."""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_clear_greedy, reference_logprobs
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import SamplingConfig
from rltool.engines.hf import HFEngine


@pytest.fixture(scope="module")
def random_model(tokenizer):
    """A tiny Qwen2 with random weights: varied, non-degenerate continuations."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 2, 2, 64)).eval()


def _random_prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, len(tokenizer), (n,), generator=gen).tolist() for n in lengths]


def _forward_shapes(model) -> tuple[list[tuple[int, int]], object]:
    """Records the [rows, tokens] of each forward's input_ids; returns (shapes, hook handle)."""
    shapes: list[tuple[int, int]] = []

    def record(module, args, kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))

    return shapes, model.register_forward_pre_hook(record, with_kwargs=True)


def _shared_vs_unshared(model, tokenizer, prompts, sampling, **engine_kwargs):
    """Both paths under the same seed; returns (shared, unshared, shared run's forward shapes)."""
    engine_kwargs = {"decode": "reference", **engine_kwargs}  # generate's prefill (lean: always)
    torch.manual_seed(11)
    plain = HFEngine(model, tokenizer, share_prefill=False, **engine_kwargs).generate(
        prompts, sampling
    )
    shapes, hook = _forward_shapes(model)
    try:
        torch.manual_seed(11)
        shared = HFEngine(model, tokenizer, **engine_kwargs).generate(prompts, sampling)
    finally:
        hook.remove()
    if not sampling.temperature:
        assert_clear_greedy(model, prompts, plain)
    # Sampled tokens under one seed: the same uniform draws pick a token from probabilities
    # a few 1e-6 apart, so one flips only for a draw within that of a boundary (~1e-4 over
    # this whole test): exact comparison is the check that the paths draw alike.
    assert [g.token_ids for g in shared] == [g.token_ids for g in plain]
    assert [g.finish_reason for g in shared] == [g.finish_reason for g in plain]
    assert [g.model_steps for g in shared] == [g.model_steps for g in plain]
    torch.testing.assert_close(
        torch.tensor([x for g in shared for x in g.logprobs]),
        torch.tensor([x for g in plain for x in g.logprobs]),
        atol=1e-5,
        rtol=0,
    )
    return shared, plain, shapes


SAMPLINGS = [
    SamplingConfig(temperature=0.0, max_new_tokens=9),
    SamplingConfig(temperature=1.0, max_new_tokens=9),
    SamplingConfig(temperature=1.3, top_p=0.9, top_k=20, max_new_tokens=9),
]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_groups_prefill_each_distinct_prompt_once(random_model, tokenizer, sampling):
    # Task-major groups of 4 over prompts of 7, 4 and 6 tokens (left padding to 7).
    a, b, c = _random_prompts(tokenizer, [7, 4, 6])
    prompts = [a] * 4 + [b] * 4 + [c] * 4
    shared, _, shapes = _shared_vs_unshared(random_model, tokenizer, prompts, sampling)
    # one prefix forward over the 3 distinct prompts but their last token, then all 12 rows
    # start from the cache with one token each
    assert shapes[:2] == [(3, 6), (12, 1)]
    for p, gen in zip(prompts, shared, strict=True):
        ref, _ = reference_logprobs(random_model, p, gen.token_ids, sampling.temperature or 1.0)
        torch.testing.assert_close(torch.tensor(gen.logprobs), ref, atol=1e-4, rtol=0)
    if sampling.temperature > 0:  # repeats are sampled independently
        assert len({tuple(g.token_ids) for g in shared[:4]}) > 1


def test_only_some_prompts_repeat(random_model, tokenizer):
    a, b, c = _random_prompts(tokenizer, [5, 8, 3], seed=1)
    prompts = [a, b, b, b, c, a]  # a twice (not adjacent), b three times, c once
    _, _, shapes = _shared_vs_unshared(random_model, tokenizer, prompts, SAMPLINGS[1])
    assert shapes[:2] == [(3, 7), (6, 1)]


def test_batch_size_splitting_a_group(random_model, tokenizer):
    # Groups of 4 in batches of 3: [a a a] [a b b] [b b]; each batch shares what repeats in it.
    a, b = _random_prompts(tokenizer, [6, 3], seed=2)
    prompts = [a] * 4 + [b] * 4
    _, _, shapes = _shared_vs_unshared(random_model, tokenizer, prompts, SAMPLINGS[1], batch_size=3)
    prefills = [s for s in shapes if s[1] > 1]
    assert prefills == [(1, 5), (2, 5), (1, 2)]


@pytest.mark.parametrize("sampling", SAMPLINGS[:2])
def test_chunked_generation_shares_the_first_prefill(random_model, tokenizer, sampling):
    # Chunks of 3 new tokens: later chunks continue from prompt + tokens so far.
    a, b = _random_prompts(tokenizer, [6, 4], seed=3)
    prompts = [a] * 3 + [b] * 3
    _, _, shapes = _shared_vs_unshared(
        random_model, tokenizer, prompts, sampling, chunk_tokens=3, model_step=4
    )
    assert shapes[:2] == [(2, 5), (6, 1)]


def test_nothing_repeats_or_one_token_prompts_take_the_plain_path(random_model, tokenizer):
    prompts = _random_prompts(tokenizer, [5, 3, 5], seed=4)
    _, _, shapes = _shared_vs_unshared(random_model, tokenizer, prompts, SAMPLINGS[0])
    assert shapes[0] == (3, 5)
    one_token = _random_prompts(tokenizer, [1], seed=5) * 3
    _, _, shapes = _shared_vs_unshared(random_model, tokenizer, one_token, SAMPLINGS[0])
    assert shapes[0] == (3, 1)


def test_a_model_whose_cache_cannot_be_shared_falls_back(tokenizer):
    # Sliding-window layers keep a cropped cache: the engine drops sharing after one try.
    config = demo_model_config(tokenizer, 32, 2, 2, 64)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 4, 0
    config.layer_types = ["sliding_attention"] * 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = Qwen2ForCausalLM(config).eval()
    a, b = _random_prompts(tokenizer, [7, 5], seed=6)
    engine = HFEngine(model, tokenizer)
    plain = HFEngine(model, tokenizer, share_prefill=False)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=6)
    for _ in range(2):
        shapes, hook = _forward_shapes(model)
        try:
            gens = engine.generate([a, a, b, b], sampling)
        finally:
            hook.remove()
        want = plain.generate([a, a, b, b], sampling)
        assert_clear_greedy(model, [a, a, b, b], want)
        assert [g.token_ids for g in gens] == [g.token_ids for g in want]
        assert (4, 7) in shapes  # the full prefill ran
    assert shapes[0] == (4, 7)  # the second call did not try to share
