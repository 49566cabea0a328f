"""A LoRA policy on Ray rollout workers: the backend asks its workers whether their engines
take adapters; where they do, the producer's sync sends the ``AdapterPayload`` and each
worker's engine loads it as in process (no merged weights), and
``rollout/weight_sync_bytes`` is the adapter's size per worker. Workers that disagree are
an error at start. Ray starts in seconds (actors import torch): the tests are slow and
share one local Ray, shut down at the end of the module."""

from __future__ import annotations

import copy
import functools

import produce_fakes
import pytest
import ray
import ray_fakes
import torch
from completions_fixture import FixtureCompletionsServer
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen2ForCausalLM

from rltool.config.schema import AgentLoopConfig, LoraConfig, RecipeConfig, RolloutConfig
from rltool.lora import ADAPTER_WEIGHTS, apply_lora
from rltool.lora_sync import adapter_payload, weights_nbytes
from rltool.metric_names import ROLLOUT_WEIGHT_SYNC_BYTES
from rltool.produce.producer import Producer
from rltool.produce.ray_backend import RayBackend
from rltool.produce.ray_setup import connect_ray
from rltool.produce.task_sampler import TaskSampler
from rltool.produce.task_specs import TaskSpec

# the actors cannot import the test directory: ship the fakes by value
ray.cloudpickle.register_pickle_by_value(ray_fakes)
ray.cloudpickle.register_pickle_by_value(produce_fakes)

WORKERS = 2
SPEC = TaskSpec(name="gsm8k", weight=1.0, loop=AgentLoopConfig(), train_files=["x"], eval_files=[])
ROWS = [{"question": f"What is {i} + 3?", "answer": f"#### {i + 3}"} for i in range(8)]


@pytest.fixture(scope="module")
def ray_cluster():
    connect_ray(RolloutConfig(num_workers=WORKERS))
    yield
    ray.shutdown()


def _sleepy_recipe() -> RecipeConfig:
    recipe = RecipeConfig()
    recipe.rollout.num_workers = WORKERS
    return recipe


@pytest.mark.slow
def test_workers_that_disagree_on_adapters_are_an_error(ray_cluster):
    both = functools.partial(ray_fakes.SleepyWorker, adapter_workers={"worker-0", "worker-1"})
    for factory, takes in [(both, True), (ray_fakes.SleepyWorker, False)]:
        backend = RayBackend(_sleepy_recipe(), worker_factory=factory)
        assert backend.takes_adapters is takes
        backend.close()

    one = functools.partial(ray_fakes.SleepyWorker, adapter_workers={"worker-1"})
    with pytest.raises(RuntimeError, match=r"disagree.*: worker-1 load.*, worker-0 do not"):
        RayBackend(_sleepy_recipe(), worker_factory=one)


def _policy(model: torch.nn.Module) -> torch.nn.Module:
    policy = apply_lora(copy.deepcopy(model), LoraConfig(rank=4, alpha=8))
    torch.manual_seed(3)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # B != 0: the adapters change the outputs
    return policy.eval()


@pytest.mark.slow
def test_a_lora_sync_sends_each_worker_the_adapter_not_merged_weights(
    ray_cluster, tiny_checkpoint, tmp_path
):
    """Real RolloutWorkers whose engine (openai_server, a LoRA run) takes adapters, against
    the fixture server: after the producer's sync every worker has loaded the policy's
    adapter there, no full weights went, and the step's bytes are the adapter's per worker."""
    model = Qwen2ForCausalLM.from_pretrained(tiny_checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    server = FixtureCompletionsServer(copy.deepcopy(model), tokenizer)
    recipe = RecipeConfig()
    recipe.model.path, recipe.model.device = str(tiny_checkpoint), "cpu"
    recipe.model.lora = LoraConfig(enabled=True, rank=4, alpha=8)
    recipe.rollout.engine, recipe.rollout.servers = "openai_server", [server.url]
    recipe.rollout.server.model, recipe.rollout.server.weights_dir = "tiny", str(tmp_path)
    recipe.rollout.num_workers = WORKERS
    recipe.rollout.sampling.max_new_tokens = 4
    recipe.data.prompts_per_step, recipe.data.group_size = WORKERS, 2  # a group per worker
    backend = RayBackend(recipe)
    try:
        assert backend.takes_adapters
        sampler = TaskSampler([SPEC], {"gsm8k": ROWS}, seed=0, shuffle=False)
        producer = Producer(recipe, backend, sampler)
        before = producer.produce(1)
        assert len(before.groups) == WORKERS
        assert ROLLOUT_WEIGHT_SYNC_BYTES not in before.extra_metrics  # nothing synced yet
        assert {r["model"] for r in server.requests} == {"tiny"}  # the base

        policy = _policy(model)
        producer.update_weights(policy, 1)
        payload = adapter_payload(policy)
        assert server.weights == []  # no merged full weights went
        assert len(server.adapters) == WORKERS  # each worker's engine loaded its own
        for load in server.lora_loads:
            sent = load_file(f"{load['lora_path']}/{ADAPTER_WEIGHTS}")
            assert sent.keys() == payload.tensors.keys()
            assert all(torch.equal(sent[k], payload.tensors[k]) for k in sent)

        server.requests.clear()
        after = producer.produce(2)
        assert len(after.groups) == WORKERS
        assert {r["model"] for r in server.requests} == set(server.adapters)
        assert all(s.response_model_steps[0] == 1 for g in after.groups for s in g)
        # each worker's engine was handed the adapter once; the step sums the workers. One
        # layer, hidden 32, MLP 64, rank 4, fp32: A [4, in] + B [out, 4] on q/k/v/o (32 -> 32)
        # and gate/up/down (32 <-> 64): 4 * (4 * 64 + 3 * 96) * 4 bytes
        assert weights_nbytes(payload) == 8704
        assert after.extra_metrics[ROLLOUT_WEIGHT_SYNC_BYTES] == WORKERS * 8704
    finally:
        backend.close()
        server.kill()
