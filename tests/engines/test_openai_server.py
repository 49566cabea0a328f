"""The openai_server engine against real HTTP servers on 127.0.0.1 (the fixture of
completions_fixture.py: HF-backed, not vLLM; vLLM itself: tests/vllm_env)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from completions_fixture import FixtureCompletionsServer
from hf_reference import assert_clear_greedy
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.checks import check_values
from rltool.config.schema import (
    LoraConfig,
    ModelConfig,
    RecipeConfig,
    RolloutConfig,
    SamplingConfig,
)
from rltool.engines.hf import HFEngine
from rltool.engines.openai_pool import ServerPool, ServersDown
from rltool.engines.openai_server import OpenAIServerEngine
from rltool.engines.registry import build_engine
from rltool.lora import apply_lora, engine_model, merged_copy

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6)


def _model(seed: int, tokenizer) -> Qwen2ForCausalLM:
    """A tiny random model whose greedy text varies (weights drawn wider than the init's)."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 1, 2, 64)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def model(tokenizer):
    return _model(0, tokenizer)


@pytest.fixture
def servers(model, tokenizer):
    made = [FixtureCompletionsServer(copy.deepcopy(model), tokenizer) for _ in range(2)]
    yield made
    for s in made:
        if s.httpd.socket.fileno() != -1:
            s.kill()


def _engine(urls, tokenizer, tmp_path=None, **kw) -> OpenAIServerEngine:
    pool = ServerPool(urls, timeout_s=30, retries=kw.pop("retries", 2), concurrency=2)
    weights = "" if tmp_path is None else str(tmp_path / "weights")
    return OpenAIServerEngine(pool, tokenizer, "tiny", weights_dir=weights, **kw)


def _prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(f"Q: what is {i} plus {2 * i}? A:") for i in range(n)]


def test_greedy_equals_hf_spread_over_both_servers(servers, model, tokenizer):
    prompts = _prompts(tokenizer, 8)
    engine = _engine([s.url for s in servers], tokenizer)
    got = engine.generate(prompts, GREEDY)
    want = HFEngine(model, tokenizer).generate(prompts, GREEDY)
    assert_clear_greedy(model, prompts, want)  # one request per prompt vs a batch of 8
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
        assert g.model_steps == [0] * len(g.token_ids)
    answered = engine.pool.answered
    assert sum(answered.values()) == 8 and min(answered.values()) >= 1  # spread
    assert engine.pop_metrics() == {"rollout/server_retries": 0.0, "rollout/servers_dropped": 0.0}
    engine.shutdown()


def test_a_groups_repeats_are_one_request_with_n_samples(servers, tokenizer):
    prompts = [p for p in _prompts(tokenizer, 3) for _ in range(4)]  # 3 groups of 4
    sampling = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=5)
    engine = _engine([servers[0].url], tokenizer)
    torch.manual_seed(1)
    got = engine.generate(prompts, sampling)
    assert len(got) == 12 and all(len(g.token_ids) >= 1 for g in got)
    bodies = servers[0].requests
    assert [b["n"] for b in bodies] == [4, 4, 4]
    assert sorted(b["prompt"] for b in bodies) == sorted(_prompts(tokenizer, 3))  # any order
    assert {
        (b["temperature"], b["top_p"], b["logprobs"], b["return_token_ids"]) for b in bodies
    } == {(1.0, 0.9, 0, True)}
    engine.shutdown()


def test_a_killed_server_is_retried_on_the_other_and_counted(servers, model, tokenizer):
    servers[0].kill()
    prompts = _prompts(tokenizer, 6)
    engine = _engine([s.url for s in servers], tokenizer)
    got = engine.generate(prompts, GREEDY)
    want = HFEngine(model, tokenizer).generate(prompts, GREEDY)
    assert_clear_greedy(model, prompts, want)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.pool.answered == {servers[0].url: 0, servers[1].url: 6}
    retries = engine.pop_metrics()["rollout/server_retries"]
    assert retries >= 1  # at least the first request sent to the dead one
    assert engine.pop_metrics()["rollout/server_retries"] == 0  # popped: reset
    engine.shutdown()


def test_a_server_error_is_retried(servers, tokenizer):
    servers[0].fail_next = 1
    engine = _engine([servers[0].url], tokenizer, retries=1)
    got = engine.generate(_prompts(tokenizer, 1), GREEDY)
    assert len(got[0].token_ids) >= 1
    assert len(servers[0].requests) == 2  # the 500, then the retry on the only server
    assert engine.pop_metrics()["rollout/server_retries"] == 1.0
    engine.shutdown()


def test_all_servers_down_is_an_error_naming_them(servers, tokenizer):
    urls = [s.url for s in servers]
    for s in servers:
        s.kill()
    engine = _engine(urls, tokenizer, retries=1)
    with pytest.raises(ServersDown) as err:
        engine.generate(_prompts(tokenizer, 1), GREEDY)
    assert urls[0] in str(err.value) and urls[1] in str(err.value)
    assert "rollout.servers" in str(err.value)
    engine.shutdown()


def test_a_refused_request_is_not_retried(servers, tokenizer):
    pool = ServerPool([servers[0].url], timeout_s=30, retries=2, concurrency=1)
    engine = OpenAIServerEngine(pool, tokenizer, "not-served")
    with pytest.raises(ValueError, match=r"refused the request \(404\).*not-served"):
        engine.generate(_prompts(tokenizer, 1), GREEDY)
    assert len(servers[0].requests) == 1
    engine.shutdown()


def test_weights_reach_every_server_and_stamp_the_tokens(servers, model, tokenizer, tmp_path):
    new = _model(7, tokenizer)
    engine = _engine([s.url for s in servers], tokenizer, tmp_path)
    prompts = _prompts(tokenizer, 6)
    before = engine.generate(prompts, GREEDY)
    engine.load_weights(new.state_dict(), 3)
    assert engine.model_step == 3
    assert [s.resets for s in servers] == [1, 1]
    assert [s.rpcs[0]["args"][1] for s in servers] == ["3", "3"]
    files = list((tmp_path / "weights").iterdir())
    assert [f.name for f in files] == [f"rltool-step00000003-{engine._tag}.safetensors"]
    got = engine.generate(prompts, GREEDY)
    want = HFEngine(new, tokenizer).generate(prompts, GREEDY)
    assert_clear_greedy(new, prompts, want)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.token_ids for g in got] != [b.token_ids for b in before]  # the weights changed
    assert all(g.model_steps == [3] * len(g.token_ids) for g in got)
    engine.load_weights(model.state_dict(), 4)  # the older file is removed
    assert [f.name for f in (tmp_path / "weights").iterdir()] == [
        f"rltool-step00000004-{engine._tag}.safetensors"
    ]
    with pytest.raises(ValueError, match=r"goes back from step 4"):
        engine.load_weights(model.state_dict(), 2)
    engine.shutdown()


def test_sync_weights_sends_the_trainers_model(servers, tokenizer, tmp_path):
    trainer_model = _model(5, tokenizer)
    pool = ServerPool([servers[0].url], timeout_s=30)
    engine = OpenAIServerEngine(
        pool, tokenizer, "tiny", weights_dir=str(tmp_path), model=trainer_model
    )
    engine.sync_weights(1)
    prompts = _prompts(tokenizer, 3)
    got = engine.generate(prompts, GREEDY)
    want = HFEngine(trainer_model, tokenizer).generate(prompts, GREEDY)
    assert_clear_greedy(trainer_model, prompts, want)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    engine.shutdown()


@pytest.mark.parametrize("held", ["base model (sync in process)", "peft model"])
def test_a_lora_policy_reaches_the_servers_merged_under_the_base_names(
    servers, model, tokenizer, tmp_path, held
):
    """The servers load plain checkpoints: ``sync_weights`` of a LoRA policy sends
    W + scale * B @ A under the base model's names, whichever object the engine holds
    (the in-process backend hands it the peft model's base model, adapters inside)."""
    policy = apply_lora(
        copy.deepcopy(model), LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    )
    torch.manual_seed(3)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # B != 0: the adapters change the weights
    held_model = engine_model(policy) if held.startswith("base") else policy
    pool = ServerPool([servers[0].url], timeout_s=30)
    engine = OpenAIServerEngine(
        pool, tokenizer, "tiny", weights_dir=str(tmp_path), model=held_model
    )
    engine.sync_weights(1)
    (received,) = servers[0].weights
    merged = merged_copy(policy).state_dict()
    assert set(received) == set(model.state_dict()) == set(merged)  # no lora_A, no base_layer
    for name, value in received.items():
        torch.testing.assert_close(value, merged[name], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(received[q], model.state_dict()[q])  # the adapters are in
    prompts = _prompts(tokenizer, 3)
    got = engine.generate(prompts, GREEDY)
    want = HFEngine(merged_copy(policy).eval(), tokenizer).generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(g.model_steps == [1] * len(g.token_ids) for g in got)
    engine.shutdown()


def test_weights_synced_mid_generation_apply_at_the_next_pause_point(
    servers, model, tokenizer, tmp_path
):
    """chunk_tokens=2: the weights handed over during the first chunk are loaded before
    the second; tokens 0-1 come from the old model (step 0), the rest from the new (step 2,
    which replaced step 1 while both waited)."""
    new = _model(7, tokenizer)
    engine = _engine([servers[0].url], tokenizer, tmp_path, chunk_tokens=2)
    handed = threading.Event()

    def hand_over_once() -> None:
        if not handed.is_set():
            handed.set()
            engine.load_weights(new.state_dict(), 1)
            assert engine.weights_waiting  # generate is running: it waits
            engine.load_weights(new.state_dict(), 2)  # replaces step 1's, still waiting

    servers[0].on_completion = hand_over_once
    prompt = _prompts(tokenizer, 1)[0]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=6)
    got = engine.generate([prompt], sampling)[0]
    head = HFEngine(model, tokenizer).generate([prompt], SamplingConfig(0.0, max_new_tokens=2))
    rest = HFEngine(new, tokenizer).generate(
        [prompt + head[0].token_ids], SamplingConfig(0.0, max_new_tokens=4)
    )
    assert_clear_greedy(model, [prompt], head)
    assert_clear_greedy(new, [prompt + head[0].token_ids], rest)
    assert got.token_ids == head[0].token_ids + rest[0].token_ids
    assert got.model_steps == [0, 0] + [2] * (len(got.token_ids) - 2)
    assert not engine.weights_waiting and engine.model_step == 2
    assert [s["args"][1] for s in servers[0].rpcs] == ["2"]  # step 1's never loaded
    assert len(list((tmp_path / "weights").iterdir())) == 1  # nor kept
    engine.shutdown()


def test_a_stop_string_across_pause_points_ends_the_row(servers, model, tokenizer):
    prompts = _prompts(tokenizer, 4)
    free = HFEngine(model, tokenizer).generate(prompts, SamplingConfig(0.0, max_new_tokens=8))
    stop = free[0].text[2:5]  # a stop string the greedy text reaches
    assert stop.strip()
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8, stop=[stop])
    want = HFEngine(model, tokenizer).generate(prompts, sampling)
    assert_clear_greedy(model, prompts, want)
    engine = _engine([servers[0].url], tokenizer, chunk_tokens=1)
    got = engine.generate(prompts, sampling)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert got[0].finish_reason == "stop"
    engine.shutdown()


def test_recipe_keys_build_the_engine_and_are_checked(servers, tokenizer, monkeypatch):
    rollout = RolloutConfig(engine="openai_server", servers=[servers[0].url + "/"])
    rollout.server.model, rollout.server.api_key_env = "tiny", "RLTOOL_TEST_KEY"
    with pytest.raises(ValueError, match=r"rollout.server.api_key_env = 'RLTOOL_TEST_KEY'"):
        build_engine(rollout, ModelConfig(), None, tokenizer)
    monkeypatch.setenv("RLTOOL_TEST_KEY", "secret")
    engine = build_engine(rollout, ModelConfig(), None, tokenizer)
    assert engine.pool.answered == {servers[0].url: 0}  # trailing slash dropped
    assert engine.pool._client.headers["Authorization"] == "Bearer secret"
    engine.shutdown()
    with pytest.raises(ValueError, match=r"rollout.servers is empty"):
        build_engine(RolloutConfig(engine="openai_server"), ModelConfig(), None, tokenizer)
    with pytest.raises(ValueError, match=r"rollout.servers\[0\] = 'localhost:8000'"):
        ServerPool(["localhost:8000"])
    with pytest.raises(ValueError, match=r"rollout.server.weights_dir is empty"):
        OpenAIServerEngine(ServerPool([servers[0].url]), tokenizer, "tiny").load_weights({}, 1)
    recipe = RecipeConfig()
    recipe.rollout.server.retries, recipe.rollout.server.timeout_s = -1, 0.0
    assert check_values(recipe) == [
        "rollout.server.timeout_s = 0: must be > 0",
        "rollout.server.retries = -1: must be >= 0",
    ]


def test_a_server_that_misses_a_weight_update_is_dropped(servers, tokenizer, tmp_path):
    new = _model(7, tokenizer)
    engine = _engine([s.url for s in servers], tokenizer, tmp_path)
    servers[0].kill()
    engine.load_weights(new.state_dict(), 1)  # the live one loads; the dead one is out
    assert engine.pool.live == [servers[1].url]
    assert engine.pop_metrics()["rollout/servers_dropped"] == 1.0
    prompts = _prompts(tokenizer, 4)
    got = engine.generate(prompts, GREEDY)
    want = HFEngine(new, tokenizer).generate(prompts, GREEDY)
    assert_clear_greedy(new, prompts, want)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.pop_metrics()["rollout/server_retries"] == 0.0  # never tried again
    servers[1].kill()
    with pytest.raises(ServersDown, match=r"no server left in rollout.servers: ") as err:
        engine.load_weights(new.state_dict(), 2)
    assert servers[0].url in str(err.value) and servers[1].url in str(err.value)
    engine.shutdown()


def test_the_logprobs_method_is_called_on_every_server_at_start(servers, tokenizer):
    pool = ServerPool([s.url for s in servers], timeout_s=30)
    engine = OpenAIServerEngine(pool, tokenizer, "tiny", logprobs_method="rltool_tempered_logprobs")
    assert [s.rpcs for s in servers] == [[{"method": "rltool_tempered_logprobs"}]] * 2
    engine.shutdown()
    pool = ServerPool([servers[0].url], timeout_s=30)
    with pytest.raises(
        RuntimeError, match=r"refused 'no_such_method' \(400\).*VLLM_SERVER_DEV_MODE"
    ):
        OpenAIServerEngine(pool, tokenizer, "tiny", logprobs_method="no_such_method")
    pool.close()
