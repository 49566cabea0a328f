"""The openenv loop against real OpenEnv servers (openenv-core in .venv-envs): episodes
recorded token-exactly with the game's tokens masked, rewards summed or last, and each way
an environment fails: a step that raises, a server that is down, one that never answers the
handshake, a step that hangs, an observation without the configured field."""

from __future__ import annotations

import itertools
import random
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openenv", reason="openenv-core is not installed (bash scripts/envs_env.sh)")

from hung_server import HungServer

from rltool.agent_loops.base import LoopContext
from rltool.agent_loops.openenv import OpenEnvLoop
from rltool.agent_loops.openenv_server import LocalServer, free_port
from rltool.config.schema import SamplingConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.engines.base import Generation, RolloutEngine
from rltool.rollout.contract import check_sample, errors
from rltool.rollout.failures import failure_reason
from rltool.rollout.state import IGNORE_INDEX, Status

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LOGPROB = -0.25
SEED = 3
SECRET = random.Random(SEED).randint(1, 9)  # the game's draw for reset(seed=3): 4
TASK = {"question": "guess", "answer": "", "reset": {"seed": SEED}}


class ScriptedGuesser(RolloutEngine):
    """Replies ``#### <guesses[k]>`` + EOS at the k-th assistant turn of the context."""

    def __init__(self, tokenizer, guesses: list[int]):
        self.tokenizer, self.guesses = tokenizer, guesses
        self.calls = 0
        self._lock = threading.Lock()

    @property
    def model_step(self) -> int:
        return 1

    def sync_weights(self, model_step: int) -> None:
        pass

    def load_weights(self, state_dict, model_step: int) -> None:
        pass

    def generate(self, prompts, sampling):
        with self._lock:
            self.calls += 1
        out = []
        for p in prompts:
            context = self.tokenizer.decode(list(p), skip_special_tokens=False)
            k = context.count("<|im_start|>assistant") - 1  # the turn being generated
            ids = self.tokenizer.encode(f"#### {self.guesses[k]}", add_special_tokens=False)
            ids = [*ids, self.tokenizer.eos_token_id]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(Generation(ids, [LOGPROB] * len(ids), [1] * len(ids), "stop", text))
        return out


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer()


@pytest.fixture(scope="module")
def server():
    """The guess game (whose step raises on a guess of 0), served once for the module."""
    s = LocalServer("openenv_faulty:app", str(HERE), {}, startup_timeout_s=60)
    yield s
    s.stop()


def make_loop(tokenizer, guesses, **options) -> OpenEnvLoop:
    engine = ScriptedGuesser(tokenizer, guesses)
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=8), task_name="guess")
    return OpenEnvLoop(ctx, **options)


def spans(labels) -> list[tuple[int, int]]:
    sup = (np.asarray(labels) != IGNORE_INDEX).astype(np.int8)  # [T]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], sup, [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def test_an_episode_is_recorded_token_exactly_with_the_games_turns_masked(tokenizer, server):
    loop = make_loop(tokenizer, [5, 2, SECRET], url=server.url)
    ((state,),) = loop.generate_groups([TASK], 1, ["g0"])
    assert state.status == Status.COMPLETED, state.error
    assert state.reward == {"score": 1.0, "step_rewards": [0.0, 0.0, 1.0], "done": True}
    assert errors(check_sample(state)) == []
    # the whole episode is the chat template's render of its messages, as generated
    render = tokenizer.apply_chat_template(state.messages, tokenize=False)
    recorded = tokenizer.decode(state.input_ids.tolist(), skip_special_tokens=False)
    assert render.startswith(recorded) and render[len(recorded) :] == "\n"
    assert [m["role"] for m in state.messages] == ["user", "assistant"] * 3
    # the three replies are trained; the prompt and the game's two answers are not
    runs = spans(state.labels)
    replies = [tokenizer.decode(state.input_ids[a:b].tolist()) for a, b in runs]
    assert replies == ["#### 5<|im_end|>", "#### 2<|im_end|>", f"#### {SECRET}<|im_end|>"]
    assert runs[0][0] == len(state.prompt_ids)
    gaps = [
        tokenizer.decode(state.input_ids[b:a].tolist())
        for (_, b), (a, _) in itertools.pairwise(runs)
    ]
    assert gaps == [
        "\n<|im_start|>user\nMy number is lower than 5. 3 guesses left.<|im_end|>\n"
        "<|im_start|>assistant\n",
        "\n<|im_start|>user\nMy number is higher than 2. 2 guesses left.<|im_end|>\n"
        "<|im_start|>assistant\n",
    ]
    for b, a in [(runs[0][1], runs[1][0]), (runs[1][1], runs[2][0])]:
        assert set(state.labels[b:a].tolist()) == {IGNORE_INDEX}
        assert set(state.logprobs[b:a].tolist()) == {0.0}
    sup = np.asarray(state.labels) != IGNORE_INDEX
    assert np.allclose(state.logprobs[sup], LOGPROB)
    metrics = loop.pop_metrics()
    assert metrics["openenv/errors"] == 0.0 and metrics["agent/turns_per_session"] == 3.0
    assert metrics["openenv/done_frac"] == 1.0


def test_reward_mode_last_and_a_lost_game_and_a_cut_episode(tokenizer, server):
    miss = [n for n in range(1, 10) if n != SECRET]
    cases = [  # (guesses, options, score, step rewards, done)
        ([5, SECRET], {"reward_mode": "last"}, 1.0, [0.0, 1.0], True),
        (miss[:4], {}, 0.0, [0.0] * 4, True),  # four misses end the game
        (miss[:4], {"max_turns": 2}, 0.0, [0.0] * 2, False),  # cut by max_turns
    ]
    for guesses, options, score, steps, done in cases:
        loop = make_loop(tokenizer, guesses, url=server.url, **options)
        ((state,),) = loop.generate_groups([TASK], 1, ["g0"])
        assert state.status == Status.COMPLETED, state.error
        assert state.reward == {"score": score, "step_rewards": steps, "done": done}
        assert state.extra["done"] is done and state.extra["env_steps"] == len(steps)


def test_groups_run_in_lockstep_one_engine_call_per_turn(tokenizer, server):
    loop = make_loop(tokenizer, [5, SECRET], url=server.url)
    tasks = [TASK, {**TASK, "reset": {"seed": SEED}}]
    groups = loop.generate_groups(tasks, 3, ["a", "b"])
    assert [len(g) for g in groups] == [3, 3]
    assert {s.group_id for s in groups[1]} == {"b"}
    assert all(s.status == Status.COMPLETED and s.score == 1.0 for g in groups for s in g)
    assert loop.engine.calls == 2  # two turns, six episodes each


def test_a_step_that_raises_fails_the_sample_with_its_reason_counted(tokenizer, server):
    loop = make_loop(tokenizer, [5, 0], url=server.url)
    ((a, b),) = loop.generate_groups([TASK], 2, ["g0"])
    for state in (a, b):
        assert state.status == Status.FAILED and state.reward is None
        assert "the reward function divided by zero" in state.error
        assert failure_reason(state.error) == "openenv: step failed on the server"
    metrics = loop.pop_metrics()
    assert metrics["openenv/errors"] == 2.0
    assert metrics["openenv/errors/step_failed_on_the_server"] == 2.0


def test_a_server_that_is_down_fails_fast_and_is_counted(tokenizer):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    loop = make_loop(tokenizer, [5], url=url, connect_timeout_s=1.0, retries=1)
    start = time.monotonic()
    ((a, b),) = loop.generate_groups([TASK], 2, ["g0"])
    assert time.monotonic() - start < 10  # one retry after 0.5 s: the run is not stalled
    for state in (a, b):
        assert state.status == Status.FAILED
        assert failure_reason(state.error) == "openenv: server down"
        assert url in state.error and "after 2 tries" in state.error
    assert loop.engine.calls == 0
    assert loop.pop_metrics()["openenv/errors/server_down"] == 2.0


def test_a_server_that_never_answers_the_handshake_times_out(tokenizer):
    hung = HungServer()  # accepts TCP connections, never answers
    url = hung.url.removesuffix("/v1")
    try:
        loop = make_loop(tokenizer, [5], url=url, connect_timeout_s=1.0, retries=0)
        start = time.monotonic()
        ((state,),) = loop.generate_groups([TASK], 1, ["g0"])
        assert time.monotonic() - start < 8
    finally:
        hung.close()
    assert failure_reason(state.error) == "openenv: server down"
    assert re.search(r"timed out|timeout", state.error, re.IGNORECASE), state.error


def test_a_step_that_hangs_times_out_without_stalling_the_call(tokenizer):
    slow = LocalServer(
        "guess_number:app",
        str(REPO / "recipes" / "envs"),
        {"GUESS_NUMBER_STEP_LATENCY_S": "60"},
        startup_timeout_s=60,
    )
    try:
        loop = make_loop(tokenizer, [5], url=slow.url, step_timeout_s=1.0)
        start = time.monotonic()
        ((a, b),) = loop.generate_groups([TASK], 2, ["g0"])
        assert time.monotonic() - start < 10  # 1 s timeout plus a bounded close
    finally:
        slow.stop()
    for state in (a, b):
        assert state.status == Status.FAILED
        assert failure_reason(state.error) == "openenv: step timed out"
        assert "step_timeout_s" in state.error
    assert loop.pop_metrics()["openenv/errors/step_timed_out"] == 2.0


def test_an_observation_without_the_configured_field_names_the_fields(tokenizer, server):
    loop = make_loop(tokenizer, [5], url=server.url, observation_field="text")
    ((state,),) = loop.generate_groups([TASK], 1, ["g0"])
    assert state.status == Status.FAILED
    assert state.error == (
        "openenv: observation has no field 'text' (its fields: message; set "
        "agent_loop.options.observation_field)"
    )


def test_evaluate_scores_one_episode_per_task(tokenizer, server):
    loop = make_loop(tokenizer, [SECRET] * 4, url=server.url)
    other = {**TASK, "reset": {"seed": 0}}  # secret 7: a first guess of 4 misses
    metrics = loop.evaluate([TASK, other], SamplingConfig(temperature=0.0, max_new_tokens=8))
    assert random.Random(0).randint(1, 9) != SECRET
    assert metrics["eval/n"] == 2.0 and metrics["eval/accuracy"] == pytest.approx(0.5)


def test_an_app_that_cannot_start_is_an_error_with_the_servers_output(tokenizer):
    with pytest.raises(ValueError) as info:
        make_loop(tokenizer, [5], app="no_such_module:app", app_dir=str(HERE))
    message = str(info.value)
    assert message.startswith(
        "agent_loop.options.app: the server of 'no_such_module:app' exited with"
    )
    assert 'Could not import module "no_such_module"' in message
