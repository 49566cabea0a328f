"""Per-sample sampling streams (``trainer.deterministic``): a sample's tokens do not depend
on the other samples in its batch."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import SamplingConfig
from rltool.demo.data import prompt_messages
from rltool.engines.hf import HFEngine
from rltool.engines.hf_sampling import PerSampleSampler, generators

HOT = SamplingConfig(temperature=1.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def model(tokenizer):
    """A random tiny Qwen2: near-uniform next tokens, so every draw matters."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 2, 2, 64)).eval()


def _prompt(tokenizer, question: str) -> list[int]:
    enc = tokenizer.apply_chat_template(prompt_messages(question), add_generation_prompt=True)
    return list(enc["input_ids"])


def _engine(model, tokenizer, seed: int = 5, step: int = 1) -> HFEngine:
    engine = HFEngine(model, tokenizer, batch_size=8, model_step=step)
    assert engine.seed_per_sample(seed)
    return engine


def test_a_prompt_alone_and_in_a_bigger_batch_samples_the_same_tokens(model, tokenizer):
    p = _prompt(tokenizer, "What is 2 + 3?")
    longer = _prompt(tokenizer, "Sam has 12 pencils and loses 5 of them. How many are left?")
    shorter = _prompt(tokenizer, "2 + 2?")
    torch.manual_seed(1)  # the global generator must not matter: moved between the calls
    alone = _engine(model, tokenizer).generate([p, p], HOT)
    torch.manual_seed(2)
    mixed = _engine(model, tokenizer).generate([longer, p, shorter, p], HOT)
    assert [g.token_ids for g in alone] == [mixed[1].token_ids, mixed[3].token_ids]
    assert alone[0].token_ids != alone[1].token_ids  # a group's samples are not copies
    for a, m in zip(alone, (mixed[1], mixed[3]), strict=True):  # padding moves logits a little
        assert a.logprobs == pytest.approx(m.logprobs, abs=1e-4)


def test_streams_change_with_the_seed_the_step_and_a_prompt_drawn_again(model, tokenizer):
    p = _prompt(tokenizer, "What is 2 + 3?")
    base = _engine(model, tokenizer).generate([p], HOT)[0].token_ids
    assert _engine(model, tokenizer, seed=6).generate([p], HOT)[0].token_ids != base
    assert _engine(model, tokenizer, step=2).generate([p], HOT)[0].token_ids != base
    engine = _engine(model, tokenizer)
    first, again = engine.generate([p], HOT), engine.generate([p], HOT)
    assert first[0].token_ids == base and again[0].token_ids != base  # the next k
    engine.sync_weights(2)  # a new step starts its counts again
    assert engine.generate([p], HOT)[0].token_ids == (
        _engine(model, tokenizer, step=2).generate([p], HOT)[0].token_ids
    )


def test_top_k_one_is_the_greedy_answer(model, tokenizer):
    """The warpers apply as in ``generate``'s own sampling: top-k 1 leaves one token."""
    prompts = [_prompt(tokenizer, "What is 2 + 3?"), _prompt(tokenizer, "2 + 2?")]
    greedy = HFEngine(model, tokenizer).generate(prompts, SamplingConfig(0.0, max_new_tokens=8))
    top1 = _engine(model, tokenizer).generate(prompts, SamplingConfig(top_k=1, max_new_tokens=8))
    assert [g.token_ids for g in top1] == [g.token_ids for g in greedy]


def test_the_draws_follow_the_softmax_and_never_pick_a_masked_token():
    """4000 rows, each on its own stream, one draw each: the frequencies are the softmax's
    (0.1 / 0.2 / 0.3 / 0.4, +- 0.03: over 4 standard errors) and the masked token never
    comes up."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    rows = 4000
    scores = probs.log().expand(rows, -1).clone()  # [rows, 5], the last -inf
    sampler = PerSampleSampler(SamplingConfig(), generators(range(rows), torch.device("cpu")))
    out = sampler(torch.zeros(rows, 1, dtype=torch.long), scores)  # [rows, 5]
    assert (out == 0).sum(-1).eq(1).all()  # exactly one token left per row
    chosen = out.argmax(-1)
    freq = torch.bincount(chosen, minlength=5).double() / rows
    assert freq[:4].tolist() == pytest.approx(probs[:4].tolist(), abs=0.03)
    assert freq[4] == 0


def test_a_row_continued_after_a_weights_pause_keeps_its_stream(model, tokenizer):
    """Weights arriving mid-generation pause the batch after 3 tokens and continue the
    unfinished rows in a new ``generate`` call: each row goes on drawing from its stream
    (the same weights here), so the tokens are those of an unpaused run."""
    p = _prompt(tokenizer, "What is 2 + 3?")
    plain = _engine(model, tokenizer).generate([p, p], HOT)
    engine = HFEngine(model, tokenizer, batch_size=8, model_step=1, chunk_tokens=3)
    engine.seed_per_sample(5)
    first_call = engine._generate_rows

    def weights_arrive(*args):
        if engine.model_step == 1:  # the same weights, stamped as step 2
            engine._pending = (dict(model.state_dict()), 2)
        return first_call(*args)

    engine._generate_rows = weights_arrive
    paused = engine.generate([p, p], HOT)
    assert [g.model_steps[:3] for g in paused] == [[1, 1, 1]] * 2  # it did pause after 3
    assert all(2 in g.model_steps for g in paused)
    assert [g.token_ids for g in paused] == [g.token_ids for g in plain]
