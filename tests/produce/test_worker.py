"""RolloutWorker and InProcessBackend on a tiny random Qwen2: batching, errors as outcomes,
shared model in sync mode, own copy and background generation in async mode."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import RecipeConfig, SamplingConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.produce.backend import GroupRequest
from rltool.produce.inprocess import InProcessBackend
from rltool.produce.worker import FINISHED_AT, RolloutWorker, batches

TASKS = [
    {"question": "What is 2 + 3?", "answer": "#### 5"},
    {"question": "What is 4 + 4?", "answer": "#### 8"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer()


@pytest.fixture
def model(tokenizer):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 1, 2, 64))


def recipe(mode: str = "sync", chunk: int | None = None) -> RecipeConfig:
    r = RecipeConfig()
    r.produce.mode = mode
    r.rollout.chunk_tokens = chunk
    r.rollout.sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    return r


def requests(n_groups: int = 2, n: int = 3) -> list[GroupRequest]:
    return [GroupRequest("gsm8k", TASKS[k % 2], f"s1-g{k}-p{k}", n) for k in range(n_groups)]


def test_batches_split_by_task_group_size_and_sampling():
    greedy = SamplingConfig(temperature=0.0)
    rs = [
        GroupRequest("a", {}, "g0", 2),
        GroupRequest("b", {}, "g1", 2),
        GroupRequest("a", {}, "g2", 2),
        GroupRequest("a", {}, "g3", 3),
        GroupRequest("a", {}, "g4", 2, sampling=greedy),
        GroupRequest("a", {}, "g5", 2, sampling=SamplingConfig(temperature=0.0)),
        # a loop runs a batch with one sampling: another budget is another batch
        GroupRequest("a", {}, "g6", 2, sampling=SamplingConfig(temperature=0, max_new_tokens=8)),
    ]
    assert [[r.group_id for r in b] for b in batches(rs)] == [
        ["g0", "g2"],
        ["g1"],
        ["g3"],
        ["g4", "g5"],
        ["g6"],
    ]


def test_worker_generates_one_outcome_per_request_in_one_engine_call(model, tokenizer):
    worker = RolloutWorker(recipe(), model=model, tokenizer=tokenizer)
    calls = []
    generate = worker.engine.generate
    worker.engine.generate = lambda prompts, s: calls.append(len(prompts)) or generate(prompts, s)
    outcomes = worker.generate(requests(2, 3))
    assert calls == [6]  # 2 groups x 3 samples, one batched call
    assert [o.request.group_id for o in outcomes] == ["s1-g0-p0", "s1-g1-p1"]
    for o in outcomes:
        assert o.error is None and len(o.group) == 3 and o.worker == "worker-0"
        assert [s.rollout_id for s in o.group] == [f"{o.request.group_id}/{i}" for i in range(3)]
        assert o.metrics[FINISHED_AT] > 0 and o.gen_time_s > 0
    assert "reward/errors" in outcomes[0].metrics and "reward/errors" not in outcomes[1].metrics


def test_a_loop_that_raises_gives_error_outcomes(model, tokenizer):
    worker = RolloutWorker(recipe(), model=model, tokenizer=tokenizer)
    bad = [GroupRequest("gsm8k", {"no_question": 1}, "s1-g0-p0", 2)]
    good = [GroupRequest("gsm8k", TASKS[0], "s1-g1-p1", 2, sampling=SamplingConfig(top_p=0.9))]
    [failed, ok] = worker.generate(bad + good)
    assert failed.group is None and "no 'question' or 'messages' field" in failed.error
    assert "worker-0" in failed.error and ok.error is None
    [unknown] = worker.generate([GroupRequest("nope", TASKS[0], "s1-g2-p2", 2)])
    assert "unknown task 'nope'" in unknown.error


def test_sync_backend_shares_the_model_and_generates_at_collect(model, tokenizer):
    backend = InProcessBackend(recipe(), model=model, tokenizer=tokenizer)
    assert backend.worker.engine.model is model
    backend.submit(requests(2, 2))
    assert backend.in_flight == 2
    outcomes = backend.collect(min_groups=1)
    assert len(outcomes) == 2 and backend.in_flight == 0
    backend.update_weights(model.state_dict(), 1)  # only stamps the step
    assert backend.worker.model_step == 1
    assert (
        backend.evaluate("gsm8k", TASKS, SamplingConfig(temperature=0.0, max_new_tokens=4))[
            "eval/n"
        ]
        == 2
    )
    backend.close()


def test_async_backend_generates_on_its_own_copy_in_the_background(model, tokenizer):
    backend = InProcessBackend(recipe("async", chunk=2), model=model, tokenizer=tokenizer)
    try:
        copy = backend.worker.engine.model
        assert copy is not model
        backend.submit(requests(2, 2))
        backend.submit(requests(1, 2)[:1])  # a second job
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the trainer moves on; the copy keeps the old weights
        outcomes = backend.collect(min_groups=3)
        assert len(outcomes) == 3 and backend.in_flight == 0
        assert all(s.response_model_steps[0] == 0 for o in outcomes for s in o.group)
        assert not torch.equal(next(copy.parameters()), next(model.parameters()))
        backend.update_weights(model.state_dict(), 1)
        torch.testing.assert_close(next(copy.parameters()), next(model.parameters()))
        assert backend.collect(min_groups=1, timeout=0) == []
        backend.submit(requests(1, 2))
        [o] = backend.collect()
        assert set(o.group[0].response_model_steps) == {1}
        assert backend.evaluate("gsm8k", TASKS, SamplingConfig(temperature=0.0))["eval/n"] == 2
    finally:
        backend.close()
        backend.close()  # twice is fine


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_closing_the_backend_shuts_the_engine_down_once(model, tokenizer, mode):
    backend = InProcessBackend(recipe(mode), model=model, tokenizer=tokenizer)
    shutdowns = []
    backend.worker.engine.shutdown = lambda: shutdowns.append(1)
    backend.close()
    backend.close()
    assert shutdowns == [1]
