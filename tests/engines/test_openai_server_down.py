"""Dead, hung and slow rollout servers under the openai_server engine: a hung server is
dropped after one timeout and the work goes on on the others, ``deadline_s`` bounds a round
whatever the retries, and a weight sync with no server left names each one and why."""

from __future__ import annotations

import copy
import logging
import time

import pytest
import torch
from completions_fixture import FixtureCompletionsServer
from hf_reference import assert_clear_greedy
from hung_server import HungServer
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.checks import check_values
from rltool.config.schema import RecipeConfig, SamplingConfig
from rltool.engines.hf import HFEngine
from rltool.engines.openai_pool import ServerPool, ServersDown
from rltool.engines.openai_server import OpenAIServerEngine

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=4)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    made = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 1, 2, 64)).eval()
    with torch.no_grad():
        for p in made.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)  # greedy text that varies
    return made


@pytest.fixture
def live(model, tokenizer):
    made = FixtureCompletionsServer(copy.deepcopy(model), tokenizer)
    yield made
    if made.httpd.socket.fileno() != -1:
        made.kill()


@pytest.fixture
def hung():
    made = HungServer()
    yield made
    made.close()


def _prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(f"Q: what is {i} plus {2 * i}? A:") for i in range(n)]


def test_a_hung_server_is_dropped_and_the_step_finishes_on_the_other(
    live, hung, model, tokenizer, caplog
):
    """Half the requests go to the hung server: after one timeout_s (1 s) it is dropped,
    counted and named, and they finish on the live one well within deadline_s; the next
    generate sends it nothing."""
    pool = ServerPool([hung.url, live.url], timeout_s=1.0, retries=2, concurrency=4, deadline_s=8)
    engine = OpenAIServerEngine(pool, tokenizer, "tiny")
    prompts = _prompts(tokenizer, 6)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rltool.engines.openai_pool"):
        got = engine.generate(prompts, GREEDY)
    elapsed = time.monotonic() - t0
    assert elapsed < 8, elapsed  # the deadline: the step never waits longer
    want = HFEngine(model, tokenizer).generate(prompts, GREEDY)
    assert_clear_greedy(model, prompts, want)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert pool.live == [live.url]
    assert hung.accepted >= 1
    assert engine.pop_metrics()["rollout/servers_dropped"] == 1.0
    (record,) = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert hung.url in record.getMessage() and "rollout.server.timeout_s" in record.getMessage()
    accepted = hung.accepted
    engine.generate(prompts[:2], GREEDY)
    assert hung.accepted == accepted  # never tried again
    engine.shutdown()


def test_the_deadline_bounds_a_round_whatever_the_retries(tokenizer):
    """A server that fails every request after 0.3 s, 20 retries: 21 x 0.3 s without a
    deadline; deadline_s = 1 ends the round after about 1 s, naming the deadline. The
    server is not taken for hung: it answers (503), and the attempt the deadline cut short
    only fails."""
    slow = HungServer(answer_after_s=0.3)
    pool = ServerPool([slow.url], timeout_s=5.0, retries=20, concurrency=2, deadline_s=1.0)
    engine = OpenAIServerEngine(pool, tokenizer, "tiny")
    t0 = time.monotonic()
    with pytest.raises(ServersDown, match=r"rollout.server.deadline_s = 1 passed") as err:
        engine.generate(_prompts(tokenizer, 1), GREEDY)
    elapsed = time.monotonic() - t0
    assert 0.9 < elapsed < 2.5, elapsed
    assert "HTTP 503" in str(err.value)
    assert slow.accepted < 10
    assert pool.live == [slow.url]
    engine.shutdown()
    slow.close()


def test_every_server_hung_ends_the_round_at_the_deadline_naming_them(tokenizer):
    """Two hung servers, timeout_s 30: deadline_s = 1 drops both after 1 s (an attempt given
    the whole deadline), and the error names each."""
    both = [HungServer(), HungServer()]
    pool = ServerPool([s.url for s in both], timeout_s=30.0, concurrency=2, deadline_s=1.0)
    engine = OpenAIServerEngine(pool, tokenizer, "tiny")
    t0 = time.monotonic()
    with pytest.raises(ServersDown) as err:
        engine.generate(_prompts(tokenizer, 4), GREEDY)
    assert time.monotonic() - t0 < 3.0
    for s in both:
        assert s.url in str(err.value)
    assert "rollout.server.deadline_s" in str(err.value)
    assert pool.live == []
    engine.shutdown()
    for s in both:
        s.close()


def test_a_weight_sync_with_no_server_left_names_each_and_why(live, model, tokenizer, tmp_path):
    """The dead server dropped at the first sync is still named when the second finds the
    last one down, each with its reason."""
    dead = FixtureCompletionsServer(copy.deepcopy(model), tokenizer)
    dead.kill()
    pool = ServerPool([dead.url, live.url], timeout_s=30)
    engine = OpenAIServerEngine(pool, tokenizer, "tiny", weights_dir=str(tmp_path))
    engine.load_weights(model.state_dict(), 1)
    assert pool.live == [live.url]
    live.kill()
    with pytest.raises(ServersDown) as err:
        engine.load_weights(model.state_dict(), 2)
    text = str(err.value)
    assert text.startswith("openai_server: no server left in rollout.servers: ")
    assert f"{dead.url} (/collective_rpc: ConnectError" in text
    assert f"{live.url} (/collective_rpc: ConnectError" in text
    assert "rltool train --resume" in text
    engine.shutdown()


def test_a_hung_server_misses_the_weights_and_is_dropped(live, hung, model, tokenizer, tmp_path):
    pool = ServerPool([hung.url, live.url], timeout_s=1.0)
    engine = OpenAIServerEngine(pool, tokenizer, "tiny", weights_dir=str(tmp_path))
    t0 = time.monotonic()
    engine.load_weights(model.state_dict(), 1)
    assert time.monotonic() - t0 < 5.0
    assert pool.live == [live.url]
    assert [r["args"][1] for r in live.rpcs] == ["1"]
    engine.shutdown()


def test_deadline_s_is_range_checked():
    recipe = RecipeConfig()
    assert recipe.rollout.server.deadline_s is None
    recipe.rollout.server.deadline_s = 0.0
    assert check_values(recipe) == ["rollout.server.deadline_s = 0: must be > 0 or null"]
