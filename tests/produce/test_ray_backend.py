"""RayBackend: rollout workers as Ray actors.

The pure pieces (how requests are spread, what a failure looks like) are
checked without Ray. The rest starts Ray, which takes seconds (ray.init plus an
actor that imports torch), so those tests are marked slow and share one local
Ray per module, shut down at the end. Timing-driven checks use ``SleepyWorker``
(``ray_fakes``: answers after ``task["delay_s"]``); weights and worker death
use real ``RolloutWorker``s on a tiny random model.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from pathlib import Path

import produce_fakes
import pytest
import ray
import ray_fakes
import torch
from ray.exceptions import RayActorError
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import RecipeConfig, RolloutConfig, SamplingConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.produce.backend import GroupRequest
from rltool.produce.ray_backend import RayBackend, failed_outcomes, spread
from rltool.produce.ray_deaths import death_reason
from rltool.produce.ray_setup import SHORT_RAY_TMPDIR, connect_ray, local_num_cpus, ray_tmpdir
from rltool.rollout.contract import check_group

# the actors cannot import the test directory: ship the fakes by value
ray.cloudpickle.register_pickle_by_value(ray_fakes)
ray.cloudpickle.register_pickle_by_value(produce_fakes)

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8)


def _fake_recipe(num_workers: int) -> RecipeConfig:
    recipe = RecipeConfig()
    recipe.rollout.num_workers = num_workers
    return recipe


def _req(gid: str, **task) -> GroupRequest:
    return GroupRequest(task_name="t", task=task, group_id=gid, n=2)


def _drain(backend: RayBackend, timeout: float = 120.0) -> list:
    """Collect until nothing is in flight."""
    out, deadline = [], time.monotonic() + timeout
    while backend.in_flight and time.monotonic() < deadline:
        out += backend.collect(min_groups=backend.in_flight, timeout=deadline - time.monotonic())
    assert backend.in_flight == 0, "requests still in flight after the timeout"
    return out


# --- without Ray ------------------------------------------------------------------------


def test_spread_gives_the_biggest_batches_to_the_least_loaded_workers():
    assert spread(7, [5, 0, 2]) == [(1, slice(0, 3)), (2, slice(3, 5)), (0, slice(5, 7))]
    assert spread(4, [0, 0]) == [(0, slice(0, 2)), (1, slice(2, 4))]
    assert spread(1, [3, 1, 1]) == [(1, slice(0, 1))]  # ties go to the lower index
    assert spread(0, [0, 0]) == []


def test_failed_outcomes_keep_every_request_with_the_error():
    reqs = [_req("a"), _req("b")]
    out = failed_outcomes(reqs, "worker-1", "worker worker-1 died: killed")
    assert [o.request.group_id for o in out] == ["a", "b"]
    assert all(o.group is None and o.worker == "worker-1" for o in out)
    assert {o.error for o in out} == {"worker worker-1 died: killed"}


def test_death_reason_is_one_line_with_what_and_why():
    err = RuntimeError("The actor died unexpectedly.\n\tpid: 12\n\nIt was killed by `ray.kill`.")
    assert death_reason(err) == "The actor died unexpectedly. It was killed by `ray.kill`."
    assert death_reason(RuntimeError("")) == "RuntimeError"
    long = death_reason(RuntimeError("The actor died.\nExit detail: " + "x" * 500))
    assert len(long) == 240 and long.startswith("The actor died. Exit detail: x")
    assert long.endswith("...")


def test_local_ray_has_room_for_every_worker():
    many = RolloutConfig(num_workers=64, worker_threads=2)
    assert local_num_cpus(many) == 128
    assert local_num_cpus(RolloutConfig(num_workers=1)) >= 1


def test_a_long_tmpdir_moves_a_local_rays_sockets_to_tmp():
    assert ray_tmpdir({"TMPDIR": "/tmp/short"}) is None  # Ray's own default
    assert ray_tmpdir({"TMPDIR": "/tmp/" + "x" * 95}) == SHORT_RAY_TMPDIR  # 100 characters
    assert ray_tmpdir({"TMPDIR": "/tmp/" + "x" * 95, "RAY_TMPDIR": "/mine"}) is None


# --- a Ray the backend starts itself (first: before the shared one below exists) -------


@pytest.mark.slow
def test_backend_starts_local_ray_and_close_shuts_it_down():
    assert not ray.is_initialized(), "an earlier test left Ray running"
    backend = RayBackend(_fake_recipe(1), worker_factory=ray_fakes.SleepyWorker)
    assert ray.is_initialized()
    assert 0 < backend.ray_start_s < backend.startup_s
    assert backend.health_metrics()["workers/startup_s"] == backend.startup_s
    backend.close()
    assert not ray.is_initialized()
    backend.close()  # twice is safe
    with pytest.raises(RuntimeError, match="closed"):
        backend.submit([_req("late")])


# --- one shared local Ray ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    connect_ray(RolloutConfig(num_workers=4))  # room for two backends of two workers
    yield
    ray.shutdown()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def sleepy(ray_cluster):
    backend = RayBackend(_fake_recipe(2), worker_factory=ray_fakes.SleepyWorker)
    yield backend
    backend.close()


def _wait_for(paths: list[Path], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not all of {paths} appeared in {timeout} s"
        time.sleep(0.01)


@pytest.fixture
def gate(tmp_path):
    """The gate file of SleepyWorker's gated requests: they end when the test creates it (or
    at teardown, whatever happened, so the shared workers are free for the next test). So
    what is checked is the order of events, not how long a step took; the bounds left are
    generous (a minute where the right answer takes milliseconds)."""
    path = tmp_path / "gate"
    yield path
    path.touch()


@pytest.mark.slow
def test_collect_returns_in_completion_order_and_honours_min_groups_and_timeout(sleepy, gate):
    sleepy.submit([_req("slow", gate=str(gate)), _req("fast")])  # one per worker
    assert sleepy.in_flight == 2
    first = sleepy.collect(min_groups=1, timeout=60)  # slow cannot end: its gate is shut
    assert [o.request.group_id for o in first] == ["fast"]  # completion order
    assert sleepy.in_flight == 1

    start = time.monotonic()
    assert sleepy.collect(min_groups=1, timeout=0.3) == []  # the slow one is still running
    assert time.monotonic() - start >= 0.3  # it waited the timeout out
    assert sleepy.in_flight == 1

    gate.touch()
    rest = sleepy.collect(min_groups=5)  # more than in flight: returns when none is left
    assert [o.request.group_id for o in rest] == ["slow"]
    assert sleepy.in_flight == 0
    start = time.monotonic()
    assert sleepy.collect(min_groups=3) == []  # nothing in flight: no wait
    assert time.monotonic() - start < 30

    sleepy.submit([_req(f"g{i}", delay_s=0.05) for i in range(5)])  # 3 + 2 over two calls
    got = sleepy.collect(min_groups=5)
    assert sorted(o.request.group_id for o in got) == [f"g{i}" for i in range(5)]
    assert all(o.error is None and o.group is not None for o in got)
    assert Counter(o.worker for o in got) == {"worker-0": 3, "worker-1": 2}


@pytest.mark.slow
def test_weights_reach_workers_while_they_generate(sleepy, gate):
    sleepy.submit([_req("a", gate=str(gate)), _req("b", gate=str(gate))])
    _wait_for([gate.with_name("gate.a.started"), gate.with_name("gate.b.started")])
    loading = threading.Thread(
        target=sleepy.update_weights, args=({"w": torch.full((3,), 2.0)}, 7), daemon=True
    )
    loading.start()
    loading.join(timeout=60)
    # not queued behind the generation: it returned while both were still inside it
    assert not loading.is_alive() and not gate.exists()
    assert sleepy.worker_steps() == {"worker-0": 7, "worker-1": 7}
    gate.touch()
    assert len(_drain(sleepy)) == 2
    evaluated = sleepy.evaluate("t", [{}, {}, {}], GREEDY)
    assert evaluated == {"eval/t/n": 3.0, "eval/weight_sum": 6.0}


@pytest.mark.slow
def test_a_worker_that_raises_returns_errors_and_is_not_restarted(sleepy):
    before = sleepy.health_metrics()
    sleepy.submit([_req("x", **{"raise": True}), _req("y", **{"raise": True})])
    got = _drain(sleepy)
    assert sorted(o.request.group_id for o in got) == ["x", "y"]
    for o in got:
        assert o.group is None
        assert o.error == f"worker {o.worker} raised: RuntimeError: fake loop exploded"
    assert sleepy.health_metrics() == before


@pytest.mark.slow
def test_close_kills_the_actors_but_leaves_a_ray_it_did_not_start(ray_cluster):
    backend = RayBackend(_fake_recipe(1), worker_factory=ray_fakes.SleepyWorker)
    actor = backend.actor("worker-0")
    assert ray.get(actor.pid.remote()) > 0
    backend.close()
    backend.close()
    assert ray.is_initialized()
    _wait_until_dead(actor)


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    """``ray.kill`` is asynchronous: a call sent right after it can still reach the
    actor (seen once in CI), so poll until calls fail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.pid.remote(), timeout=timeout_s)
        except RayActorError:
            return
        time.sleep(0.2)
    pytest.fail(f"actor still answers {timeout_s:.0f} s after close()")


@pytest.mark.slow
def test_close_shuts_every_worker_down_before_killing_it(ray_cluster, tmp_path):
    factory = functools.partial(ray_fakes.SleepyWorker, shutdown_dir=tmp_path)
    backend = RayBackend(_fake_recipe(2), worker_factory=factory)
    backend.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0", "worker-1"]


# --- real RolloutWorkers on a tiny random model -----------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A saved tiny checkpoint and other weights for it: the same model with its final
    norm negated, so its logits are negated and greedy picks its least likely token
    (two random tiny models both tend to repeat one token)."""
    out = tmp_path_factory.mktemp("tiny-ckpt")
    tokenizer = train_demo_tokenizer()
    cfg = demo_model_config(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    flipped = {k: v.clone() for k, v in model.state_dict().items()}
    flipped["model.norm.weight"] *= -1
    return out, flipped


@pytest.fixture(scope="module")
def workers(ray_cluster, tiny_models):
    recipe = RecipeConfig()
    recipe.model.path = str(tiny_models[0])
    recipe.model.device = "cpu"
    recipe.rollout.num_workers = 2
    recipe.rollout.chunk_tokens = 8
    backend = RayBackend(recipe)
    yield backend
    backend.close()


def _gsm8k(gid: str, sampling: SamplingConfig = GREEDY, n: int = 2) -> GroupRequest:
    task = {"question": "What is 2 + 3?", "answer": "#### 5"}
    return GroupRequest(task_name="gsm8k", task=task, group_id=gid, n=n, sampling=sampling)


@pytest.mark.slow
def test_real_workers_generate_groups_and_load_new_weights(workers, tiny_models):
    workers.submit([_gsm8k("before-0"), _gsm8k("before-1")])
    before = _drain(workers)
    assert {o.worker for o in before} == {"worker-0", "worker-1"}
    for o in before:
        assert o.error is None, o.error
        assert check_group(o.group) == []
        assert all(set(s.response_model_steps) == {0} for s in o.group)

    workers.update_weights(tiny_models[1], model_step=3)
    assert workers.worker_steps() == {"worker-0": 3, "worker-1": 3}
    workers.submit([_gsm8k("after-0"), _gsm8k("after-1")])
    after = _drain(workers)
    for o in after:
        assert o.error is None, o.error
        assert all(set(s.response_model_steps) == {3} for s in o.group)
    # greedy: same prompt, same answer on both workers; the new weights answer differently
    old = {tuple(s.response_ids) for o in before for s in o.group}
    new = {tuple(s.response_ids) for o in after for s in o.group}
    assert len(old) == 1 and len(new) == 1 and old != new


@pytest.mark.slow
def test_killed_worker_is_reported_restarted_and_loses_no_request(workers, tiny_models):
    """Runs after the weights test: the restarted worker must come back on step 3."""
    assert workers.worker_steps() == {"worker-0": 3, "worker-1": 3}
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=48)
    first = [_gsm8k(f"k{i}", sampling, n=4) for i in range(6)]
    workers.submit(first)  # k0-k2 on worker-0, k3-k5 on worker-1
    ray.kill(workers.actor("worker-1"))  # mid-generation
    got = _drain(workers)
    assert sorted(o.request.group_id for o in got) == sorted(r.group_id for r in first)
    failed = [o for o in got if o.error is not None]
    assert sorted(o.request.group_id for o in failed) == ["k3", "k4", "k5"]
    for o in failed:
        assert o.group is None and o.worker == "worker-1"
        assert o.error.startswith("worker worker-1 died: ")
        assert "ray.kill" in o.error
    health = workers.health_metrics()
    assert health["workers/restarts"] == 1.0
    assert health["workers/lost_requests"] == 3.0
    (death,) = workers.pop_deaths()  # reported once, with the error its groups carry
    assert (death.worker, death.reason) == ("worker-1", "it was killed by `ray.kill`")
    assert {o.error for o in failed} == {death.error} and death.restart_s > 0
    assert workers.pop_deaths() == []

    assert workers.worker_steps() == {"worker-0": 3, "worker-1": 3}  # current weights
    again = [_gsm8k(f"r{i}", sampling) for i in range(4)]
    workers.submit(again)
    later = _drain(workers)
    assert sorted(o.request.group_id for o in later) == [r.group_id for r in again]
    assert all(o.error is None for o in later), [o.error for o in later]
    assert {o.worker for o in later} == {"worker-0", "worker-1"}
    assert all(set(s.response_model_steps) == {3} for o in later for s in o.group)
