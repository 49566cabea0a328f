"""The openai_server engine on a server whose answers hold token ids outside the policy's
vocabulary: that sample's Generation carries the error, the others are untouched, and a
negative id is no OverflowError from the tokenizer (issue 21, item 3)."""

from __future__ import annotations

import pytest
import torch
from completions_fixture import FixtureCompletionsServer
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import SamplingConfig
from rltool.engines.openai_pool import ServerPool
from rltool.engines.openai_server import OpenAIServerEngine, parse_choice
from rltool.rollout.failures import failure_reason

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=4)


class BadIdServer(FixtureCompletionsServer):
    """Answers as the fixture does, then writes ``bad_id`` over the second token of choice
    ``index`` of every answer."""

    def __init__(self, model, tokenizer, bad_id: int, index: int = 1):
        super().__init__(model, tokenizer)
        self.bad_id, self.index = bad_id, index

    def completions(self, body):
        status, answer = super().completions(body)
        choice = answer["choices"][self.index]
        choice["token_ids"] = [choice["token_ids"][0], self.bad_id, *choice["token_ids"][2:]]
        return status, answer


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 1, 2, 64)).eval()


@pytest.mark.parametrize("bad", ["vocab_size", -1])
def test_an_id_outside_the_vocabulary_fails_only_its_sample(model, tokenizer, bad) -> None:
    vocab = model.config.vocab_size
    bad_id = vocab if bad == "vocab_size" else bad
    server = BadIdServer(model, tokenizer, bad_id)
    try:
        pool = ServerPool([server.url], timeout_s=30, retries=0, concurrency=1)
        engine = OpenAIServerEngine(pool, tokenizer, "tiny", model=model)
        assert engine.vocab_size == vocab  # the policy's embedding rows
        prompt = tokenizer.encode("Q: what is 1 plus 2? A:")
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=4)
        first, second, third = engine.generate([prompt] * 3, sampling)  # one request, n = 3
    finally:
        server.kill()
    assert first.error is None and third.error is None
    assert len(first.token_ids) >= 1 and first.text == tokenizer.decode(
        first.token_ids, skip_special_tokens=True
    )
    assert second.token_ids[1] == bad_id and second.text == ""
    assert failure_reason(second.error) == "openai_server: token id outside the vocabulary"
    assert f"token id {bad_id} outside the vocabulary [0, {vocab}) at position 1" in second.error


def test_parse_choice_names_the_id_and_keeps_good_answers() -> None:
    choice = {"token_ids": [1, 7], "logprobs": {"token_logprobs": [-0.1, -0.2]},
              "finish_reason": "stop"}  # fmt: skip
    ok = parse_choice(choice, "the server", vocab_size=8)
    assert (ok.token_ids, ok.logprobs, ok.stopped, ok.error) == ([1, 7], [-0.1, -0.2], True, None)
    bad = parse_choice(choice, "the server", vocab_size=7)
    assert bad.error is not None and "token id 7 outside the vocabulary [0, 7)" in bad.error
    huge = parse_choice({**choice, "token_ids": [1, 2**70]}, "the server", vocab_size=None)
    assert huge.error is not None and f"token id {2**70} does not fit a 64-bit" in huge.error
