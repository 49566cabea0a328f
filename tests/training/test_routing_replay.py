"""MoE routing replay, end to end on tiny random Qwen3-MoE and Mixtral models: the HF engine
records each position's experts, the gsm8k-style canonical build stores them, conversion
shifts and packs them (plain and shared-prefix rows), and the training forward replays them.

(a) routers perturbed between generation and training: without replay some tokens route
    differently; with replay the experts modules receive exactly the recorded experts;
(b) unchanged weights: training logprobs under replay equal the rollout's (ratio 1 to 1e-5);
(c) gradients reach every router under replay.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_moe

from rltool.agent_loops.canonical import build_or_fail, check_many
from rltool.config.schema import AlgorithmConfig, SamplingConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.engines.hf import HFEngine
from rltool.moe import find_routers, recording, replaying
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status
from rltool.training.batch import SharedPack
from rltool.training.convert import ConversionConfig, convert_groups
from rltool.training.logprobs import forward_logprobs
from rltool.training.updater import PolicyUpdater

ARCHS = ["qwen3_moe", "mixtral"]
GROUP = 3


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer()


def prompts(tokenizer) -> list[list[int]]:
    texts = ["What is 3 + 4?", "Zoe has 9 toys and gets 2 more. How many now?"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def rollouts(model, tokenizer, **engine_kw) -> list[list[RolloutState]]:
    """Two groups of GROUP samples, built as the gsm8k loop builds them."""
    engine = HFEngine(model, tokenizer, batch_size=8, **engine_kw)
    ps = [p for p in prompts(tokenizer) for _ in range(GROUP)]
    torch.manual_seed(1)
    gens = engine.generate(ps, SamplingConfig(temperature=1.0, max_new_tokens=6))
    states = []
    for i, (p, g) in enumerate(zip(ps, gens, strict=True)):
        s = RolloutState(
            rollout_id=f"r{i}",
            group_id=f"g{i // GROUP}",
            prompt_ids=p,
            response_ids=g.token_ids,
            routed_experts=g.routed_experts,
            reward={"score": float(i % 2)},
            status=Status.COMPLETED,
        )
        states.append(build_or_fail(s, g.logprobs, None))
    check_many(states)
    assert all(s.status == Status.COMPLETED for s in states), [s.error for s in states]
    return [states[:GROUP], states[GROUP:]]


def packs_of(groups, shared: bool):
    cfg = ConversionConfig(pack_max_length=256, prefix_sharing=shared)
    return convert_groups(groups, cfg).packs


def experts_used(model):
    """A recorder of the expert ids each experts module is called with: [N, k] per layer."""
    used: list[torch.Tensor] = []
    handles = [
        m.register_forward_hook(lambda _m, args, _out: used.append(args[1].clone()))
        for name, m in model.named_modules()
        if name.endswith("mlp.experts")
    ]
    return used, handles


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("share_prefill", [True, False])
def test_recorded_routing_is_the_routing_of_one_forward_of_the_whole_sample(
    arch, share_prefill, tokenizer
):
    """Capture through left padding, the shared prefill of repeated prompts (or each row's
    own prefill) and decode steps equals the routing of a single unpadded forward over
    prompt + response (last token: never fed, -1)."""
    model = random_moe(len(tokenizer), arch)
    routers = find_routers(model)
    for group in rollouts(model, tokenizer, share_prefill=share_prefill):
        for s in group:
            e = s.routed_experts  # [T, L, k]
            assert e.shape == (len(s.input_ids), routers.layers, routers.top_k)
            assert (e[-1] == -1).all() and (e[:-1] >= 0).all()
            ids = torch.as_tensor(s.input_ids)[None]
            with replaying(model, routers, torch.from_numpy(e), replay=False) as seen:
                model(input_ids=ids)
            assert not seen.differs[:-1].any(), np.flatnonzero(seen.differs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shared", [False, True])
def test_unchanged_weights_replay_gives_the_rollout_logprobs(arch, shared, tokenizer):
    """(b): every supervised token's training logprob under replay is the engine's, so the
    importance ratio is 1 to 1e-5; with prefix sharing the rows are shared."""
    model = random_moe(len(tokenizer), arch)
    packs = packs_of(rollouts(model, tokenizer), shared)
    assert all(isinstance(p, SharedPack) == shared for p in packs)
    routers = find_routers(model)
    for p in packs:
        with torch.no_grad(), replaying(model, routers, p.routed_experts):
            logp, _ = forward_logprobs(model, p, 1.0, False)
        live = p.targets != IGNORE_INDEX
        ratio = torch.exp(logp[live] - p.rollout_logprobs[live])
        assert live.sum() > 0
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_with_unchanged_routing_is_identical_to_no_replay(arch, tokenizer):
    """The gates are recomputed exactly as the router computes them: replaying the routing
    the model chooses anyway changes no logit."""
    model = random_moe(len(tokenizer), arch)
    [p] = packs_of(rollouts(model, tokenizer), shared=False)
    routers = find_routers(model)
    with torch.no_grad():
        with recording(model, routers) as forwards:
            plain = forward_logprobs(model, p, 1.0, False)[0]
        own = forwards[0][0]  # [N, L, k] the routing the packed forward picks itself
        with replaying(model, routers, own) as seen:
            replayed = forward_logprobs(model, p, 1.0, False)[0]
    assert not seen.differs.any()
    # Bit-equal by construction: the same forward on the same pack, and the replayed gates
    # are the router's own operations (float32 softmax, the same experts in the same order,
    # the same renormalising sum) on the same router logits.
    assert torch.equal(plain, replayed)


def perturb_routers(model, scale: float = 0.5, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in find_routers(model).modules:
            r.weight += scale * torch.randn(r.weight.shape, generator=g)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shared", [False, True])
def test_perturbed_routers_differ_without_replay_and_follow_the_rollout_with_it(
    arch, shared, tokenizer
):
    """(a) and (c)."""
    model = random_moe(len(tokenizer), arch)
    packs = packs_of(rollouts(model, tokenizer), shared)
    perturb_routers(model)
    routers = find_routers(model)
    for p in packs:
        with torch.no_grad(), replaying(model, routers, p.routed_experts, replay=False) as seen:
            forward_logprobs(model, p, 1.0, False)
        assert 0 < int(seen.differs.sum()) < len(p)  # some tokens, not all
        used, handles = experts_used(model)
        try:
            with replaying(model, routers, p.routed_experts) as seen:
                logp, _ = forward_logprobs(model, p, 1.0, False)
        finally:
            for h in handles:
                h.remove()
        assert len(used) == routers.layers
        for layer, ids in enumerate(used):  # [N, k] the experts each token went to
            assert torch.equal(ids, p.routed_experts[:, layer]), f"layer {layer}"
        assert seen.differs.any()  # the router's own choice, reported, not used
        model.zero_grad()
        (-logp[p.targets != IGNORE_INDEX].sum()).backward()
        for r in routers.modules:
            assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def make_updater(model, replay: bool) -> PolicyUpdater:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    algo = AlgorithmConfig(routing_replay=replay, tis_cap=None)
    return PolicyUpdater(model, opt, sched, algo)


@pytest.mark.parametrize("replay", [False, True])
def test_the_updater_reports_the_mismatch_and_replays_on_request(replay, tokenizer):
    """``actor/routing_mismatch``: 0 with the rollout's weights; after perturbed routers the
    fraction of the first forward (before the update); the routers train either way."""
    model = random_moe(len(tokenizer), "qwen3_moe")
    groups = rollouts(model, tokenizer)
    packs = packs_of(groups, shared=False)
    updater = make_updater(model, replay)
    before = {id(r): r.weight.detach().clone() for r in find_routers(model).modules}
    assert updater.step(packs)["actor/routing_mismatch"] == 0.0
    for r in find_routers(model).modules:
        assert not torch.equal(r.weight, before[id(r)])  # gradients reached the routers
    fresh = random_moe(len(tokenizer), "qwen3_moe")
    perturb_routers(fresh)
    # the mismatch of the first forward, counted by an independent comparison
    routers = find_routers(fresh)
    with torch.no_grad(), replaying(fresh, routers, packs[0].routed_experts, replay) as seen:
        forward_logprobs(fresh, packs[0], 1.0, False)
    assert len(packs) == 1
    expected = int(seen.differs[seen.recorded].sum()) / int(seen.recorded.sum())
    metrics = make_updater(fresh, replay).step(packs)
    assert metrics["actor/routing_mismatch"] == pytest.approx(expected, abs=1e-12)
    assert expected > 0


def test_replay_needs_routed_experts_and_an_moe_model(tokenizer):
    model = random_moe(len(tokenizer), "qwen3_moe")
    groups = rollouts(model, tokenizer, record_routing=False)
    assert groups[0][0].routed_experts is None
    packs = packs_of(groups, shared=False)
    with pytest.raises(ValueError, match=r"pack 0 carries no routed_experts.*record_routing"):
        make_updater(model, replay=True).step(packs)
    assert "actor/routing_mismatch" not in make_updater(model, replay=False).step(packs)
    from tiny_models import random_qwen2

    with pytest.raises(ValueError, match="routing_replay is true but the model is Qwen2"):
        make_updater(random_qwen2(len(tokenizer)), replay=True)


def test_a_recording_from_another_model_is_named():
    model = random_moe(40, "qwen3_moe", top_k=2)
    bad = torch.zeros(5, 3, 2, dtype=torch.long)  # 3 layers, the model has 2
    with (
        pytest.raises(ValueError, match=r"3 layers x 2 experts.*2 MoE layers x top-2"),
        replaying(model, find_routers(model), bad),
    ):
        pass
