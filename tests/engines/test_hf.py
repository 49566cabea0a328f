"""HFEngine on a tiny Qwen2 overfit to one answer: logprobs, stopping, padding, chunking."""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_clear_greedy, reference_logprobs
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config, encode_sft_example
from rltool.config.schema import SamplingConfig
from rltool.demo.data import Problem, prompt_messages
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.engines import hf_stopping
from rltool.engines.hf import HFEngine

ANSWER = "7 + 5 = 12\n#### 12"
PROBLEM = Problem("Tom has 7 apples and buys 5 more. How many apples does Tom have?", ANSWER)
OTHER = Problem(
    "Mia has 9 cups and gives 3 to Leo. How many cups does Mia have left?", "9 - 3 = 6\n#### 6"
)


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny Qwen2 trained until its greedy answers to PROBLEM and OTHER are exact."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 2, 2, 64))
        examples = [encode_sft_example(tokenizer, p) for p in (PROBLEM, OTHER)]
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(200):
            losses = [
                m(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
                for ids, labels in examples
            ]
            if max(loss.item() for loss in losses) < 0.05:
                break
            sum(losses).backward()
            opt.step()
            opt.zero_grad()
    assert max(loss.item() for loss in losses) < 0.05, "the fixture model did not memorize"
    return m


def prompt(tokenizer, question: str = PROBLEM.question) -> list[int]:
    enc = tokenizer.apply_chat_template(prompt_messages(question), add_generation_prompt=True)
    return list(enc["input_ids"])


def test_greedy_stops_at_eos_and_keeps_it(model, tokenizer):
    engine = HFEngine(model, tokenizer, batch_size=4, slots=4, model_step=3)
    [gen] = engine.generate([prompt(tokenizer)], SamplingConfig(temperature=0.0, max_new_tokens=30))
    assert_clear_greedy(model, [prompt(tokenizer)], [gen])  # the argmax below cannot flip
    expected = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert gen.token_ids == expected
    assert gen.finish_reason == "stop"
    assert gen.text == ANSWER  # special tokens skipped
    assert gen.model_steps == [3] * len(expected)
    ref, argmax = reference_logprobs(model, prompt(tokenizer), gen.token_ids, 1.0)
    assert argmax.tolist() == gen.token_ids
    torch.testing.assert_close(torch.tensor(gen.logprobs), ref, atol=1e-4, rtol=0)


def test_length_limit(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    [gen] = engine.generate([prompt(tokenizer)], SamplingConfig(temperature=0.0, max_new_tokens=3))
    assert len(gen.token_ids) == len(gen.logprobs) == len(gen.model_steps) == 3
    assert gen.finish_reason == "length"
    assert gen.text == "7 + "  # tokens "7", " +", " "


def test_stop_string_ends_the_row_and_is_kept(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=30, stop=["####"])
    [gen] = engine.generate([prompt(tokenizer)], sampling)
    assert gen.text == "7 + 5 = 12\n####"
    assert gen.finish_reason == "stop"


def test_pad_equal_to_eos_does_not_leak_into_stopped_rows(model, tokenizer):
    # With pad == eos, a row that finished early is filled with eos ids while the other
    # rows go on; a row stopped by a stop string must not gain one.
    tok = train_demo_tokenizer()
    tok.pad_token = tok.eos_token
    engine = HFEngine(model, tok, batch_size=2, slots=2)
    assert engine.pad_id == tok.eos_token_id
    prompts = [prompt(tok), prompt(tok, OTHER.question)]
    gens = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=30, stop=["-"]))
    assert [g.text for g in gens] == [ANSWER, "9 -"]
    assert gens[0].token_ids[-1] == tok.eos_token_id  # row 0 ended on EOS, row 1 was padded
    assert gens[1].token_ids == tok("9 -", add_special_tokens=False)["input_ids"]
    assert all(g.finish_reason == "stop" for g in gens)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_sampled_logprobs_match_a_manual_forward(model, tokenizer, temperature):
    # Prompts of different lengths (left padding) over two chunks (batch_size 2).
    prompts = [
        prompt(tokenizer),
        prompt(
            tokenizer, "Ella has 3 coins and gives 1 to Max. How many coins does Ella have left?"
        ),
        prompt(tokenizer, "Hi"),
    ]
    engine = HFEngine(model, tokenizer, batch_size=2, slots=2)
    torch.manual_seed(1)
    gens = engine.generate(prompts, SamplingConfig(temperature=temperature, max_new_tokens=12))
    assert len(gens) == 3
    for p, gen in zip(prompts, gens, strict=True):
        assert len(gen.token_ids) == len(gen.logprobs) >= 1
        ref, _ = reference_logprobs(model, p, gen.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(gen.logprobs), ref, atol=1e-4, rtol=0)
        if gen.finish_reason == "stop":
            assert gen.token_ids[-1] == tokenizer.eos_token_id
            assert tokenizer.eos_token_id not in gen.token_ids[:-1]
        else:
            assert len(gen.token_ids) == 12
            assert tokenizer.eos_token_id not in gen.token_ids


def test_sampling_is_reproducible_under_the_global_seed(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    sampling = SamplingConfig(temperature=1.5, top_p=0.9, top_k=20, max_new_tokens=10)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append([g.token_ids for g in engine.generate([prompt(tokenizer)] * 4, sampling)])
    assert runs[0] == runs[1]


def test_batching_and_padding_do_not_change_greedy_output(model, tokenizer):
    prompts = [prompt(tokenizer), prompt(tokenizer, "Hi"), prompt(tokenizer, "Zoe has 9 toys.")]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8)
    one = HFEngine(model, tokenizer, batch_size=1, slots=1).generate(prompts, sampling)
    together = HFEngine(model, tokenizer, batch_size=3, slots=3).generate(prompts, sampling)
    assert_clear_greedy(model, prompts, one)
    assert [g.token_ids for g in one] == [g.token_ids for g in together]
    torch.testing.assert_close(
        torch.tensor([x for g in one for x in g.logprobs]),
        torch.tensor([x for g in together for x in g.logprobs]),
        atol=1e-4,
        rtol=0,
    )


def test_training_mode_is_restored_and_weights_are_shared(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    model.train()
    engine.generate([prompt(tokenizer)], SamplingConfig(temperature=0.0, max_new_tokens=2))
    assert model.training
    model.eval()
    engine.generate([prompt(tokenizer)], SamplingConfig(temperature=0.0, max_new_tokens=2))
    assert not model.training
    assert engine.model is model


def test_sync_weights_records_the_step(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    assert engine.model_step == 0
    engine.sync_weights(5)
    [gen] = engine.generate([prompt(tokenizer)], SamplingConfig(temperature=0.0, max_new_tokens=4))
    assert gen.model_steps == [5, 5, 5, 5]
    with pytest.raises(ValueError, match="goes back"):
        engine.sync_weights(4)


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        (SamplingConfig(temperature=-1.0), "temperature"),
        (SamplingConfig(top_p=0.0), "top_p"),
        (SamplingConfig(top_k=-1), "top_k"),
        (SamplingConfig(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_bad_sampling_is_a_clear_error(model, tokenizer, sampling, match):
    with pytest.raises(ValueError, match=match):
        HFEngine(model, tokenizer).generate([prompt(tokenizer)], sampling)


def test_empty_prompt_is_named(model, tokenizer):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        HFEngine(model, tokenizer).generate([prompt(tokenizer), []], SamplingConfig())


# ---------------------------------------------------------------- chunks and load_weights


def _other_weights(tokenizer) -> dict[str, torch.Tensor]:
    """A second model's weights, same shapes: a different policy the engine can load."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 2, 2, 64)).state_dict()


def _copy_of(model) -> Qwen2ForCausalLM:
    m = Qwen2ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    return m


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_greedy_chunked_equals_unchunked(model, tokenizer, chunk):
    prompts = [prompt(tokenizer), prompt(tokenizer, OTHER.question), prompt(tokenizer, "Hi")]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=14)
    whole = HFEngine(model, tokenizer, model_step=2).generate(prompts, sampling)
    assert_clear_greedy(model, prompts, whole)
    chunked = HFEngine(model, tokenizer, model_step=2, chunk_tokens=chunk).generate(
        prompts, sampling
    )
    assert [g.token_ids for g in chunked] == [g.token_ids for g in whole]
    assert [g.finish_reason for g in chunked] == [g.finish_reason for g in whole]
    assert [g.text for g in chunked] == [g.text for g in whole]
    assert [g.model_steps for g in chunked] == [[2] * len(g.token_ids) for g in whole]
    torch.testing.assert_close(
        torch.tensor([x for g in chunked for x in g.logprobs]),
        torch.tensor([x for g in whole for x in g.logprobs]),
        atol=1e-4,
        rtol=0,
    )
    assert whole[0].finish_reason == "stop" and len(whole[0].token_ids) > 2 * chunk


def test_load_weights_when_idle_copies_now(model, tokenizer):
    engine = HFEngine(_copy_of(model), tokenizer, model_step=1)
    other = _other_weights(tokenizer)
    engine.load_weights(other, 4)
    assert engine.model_step == 4
    for name, value in engine.model.state_dict().items():
        torch.testing.assert_close(value, other[name], atol=0, rtol=0)
    with pytest.raises(ValueError, match="goes back"):
        engine.load_weights(other, 3)


def test_weights_loaded_mid_generation_apply_at_the_next_pause_point(model, tokenizer, monkeypatch):
    """Pause points every 2 tokens; weights of step 3 arrive after the first token: the call
    stops at token 2, steps [1, 1, 3, 3], and the last two tokens are the new policy's greedy
    continuation of the first two."""
    # generate's stopping criteria are patched: the reference path (the lean one: test_hf_decode.py)
    engine = HFEngine(_copy_of(model), tokenizer, model_step=1, chunk_tokens=2, decode="reference")
    other = _other_weights(tokenizer)
    record = hf_stopping.FinishRecorder.__call__

    def load_after_first_token(self, input_ids, scores, **kwargs):
        first_token = input_ids.shape[1] - self.prompt_len == 1
        if first_token and engine.model_step == 1 and not engine.weights_waiting:
            engine.load_weights(other, 3)
            assert engine.model_step == 1  # deferred: the generation is still running
        return record(self, input_ids, scores, **kwargs)

    monkeypatch.setattr(hf_stopping.FinishRecorder, "__call__", load_after_first_token)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=4)
    [gen] = engine.generate([prompt(tokenizer)], sampling)
    assert gen.model_steps == [1, 1, 3, 3]
    assert (
        gen.token_ids[:2]
        == HFEngine(model, tokenizer)
        .generate([prompt(tokenizer)], SamplingConfig(temperature=0.0, max_new_tokens=2))[0]
        .token_ids
    )
    new_policy = HFEngine(_copy_of(model), tokenizer)
    new_policy.load_weights(other, 3)
    [rest] = new_policy.generate(
        [prompt(tokenizer) + gen.token_ids[:2]],
        sampling.__class__(temperature=0.0, max_new_tokens=2),
    )
    assert gen.token_ids[2:] == rest.token_ids
    assert engine.model_step == 3


def test_pause_points_without_new_weights_do_not_stop_generation(model, tokenizer):
    # the reference path; the lean loop's: test_hf_refill.py
    engine = HFEngine(_copy_of(model), tokenizer, model_step=1, chunk_tokens=2, decode="reference")
    calls = []
    generate_rows = engine._generate_rows
    engine._generate_rows = lambda *args: calls.append(1) or generate_rows(*args)
    [gen] = engine.generate([prompt(tokenizer)], SamplingConfig(temperature=0.0, max_new_tokens=6))
    assert len(calls) == 1  # one generate call: the KV cache is never rebuilt
    assert gen.model_steps == [1] * len(gen.token_ids)


@pytest.mark.parametrize("decode", ["lean", "reference"])
def test_load_weights_from_another_thread_waits_for_a_chunk_boundary(model, tokenizer, decode):
    """A trainer thread hands weights over while the first decode step runs: the call goes on
    to the pause point (3 tokens), then on the new weights."""
    import threading

    policy = _copy_of(model)
    engine = HFEngine(policy, tokenizer, model_step=0, chunk_tokens=3, decode=decode)
    started, loaded, forwards = threading.Event(), threading.Event(), []

    def block_in_second_forward(_module, _args):  # a prefill, then the first decode step
        forwards.append(1)
        if len(forwards) == 2:
            started.set()
            assert loaded.wait(30), "the main thread never loaded weights"

    hook = policy.register_forward_pre_hook(block_in_second_forward)
    out = []
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=9)
    worker = threading.Thread(
        target=lambda: out.extend(engine.generate([prompt(tokenizer)], sampling))
    )
    try:
        worker.start()
        assert started.wait(30)
        engine.load_weights(_other_weights(tokenizer), 2)  # returns at once: a chunk is running
        assert engine.model_step == 0
        loaded.set()
        worker.join(60)
    finally:
        loaded.set()
        hook.remove()
    [gen] = out
    assert gen.model_steps[:3] == [0, 0, 0]
    assert set(gen.model_steps[3:]) == {2} and engine.model_step == 2
