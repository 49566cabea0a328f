"""On-policy distillation: teacher alignment, the two losses by hand, and the update they drive.

Regression lock for the teacher's alignment: teacher_targets[t] describes the
token AT t (read from the teacher's logits at t - 1), so after the conversion's
one shift a Pack's teacher logprob at j is the teacher's logprob of target j.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from tiny_models import random_qwen2
from token_margins import MARGIN, top_gaps

from rltool.config.schema import AlgorithmConfig, DistillConfig, OptimizerConfig
from rltool.produce.teacher import TeacherScorer, check_same_tokenizer, teacher_targets_from_logits
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status
from rltool.training.batch import Pack
from rltool.training.convert import ConversionConfig, convert_groups
from rltool.training.distill import (
    distill_term,
    forward_kl_topk,
    forward_logprobs_distill,
    reverse_kl_sampled,
)
from rltool.training.logprobs import forward_logprobs
from rltool.training.optim import build_scheduler
from rltool.training.updater import PolicyUpdater

VOCAB = 61
TASK = "gsm8k"


def tiny_qwen2(seed: int) -> torch.nn.Module:
    return random_qwen2(VOCAB, seed=seed, hidden_size=32, intermediate_size=64, max_positions=64)


def sample(rid: str, prompt: list[int], response: list[int], gid: str = "g") -> RolloutState:
    """A COMPLETED prompt+response sample without a reward (a task of weight 0 needs none)."""
    return RolloutState(
        rollout_id=rid,
        group_id=gid,
        task_name=TASK,
        prompt_ids=prompt,
        response_ids=response,
        input_ids=prompt + response,
        labels=[IGNORE_INDEX] * len(prompt) + response,
        status=Status.COMPLETED,
    )


def groups_of(seed: int = 0) -> list[list[RolloutState]]:
    """Two groups of two samples, different lengths, random tokens."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    return [
        [sample("a0", ids(3), ids(5), "a"), sample("a1", ids(3), ids(7), "a")],
        [sample("b0", ids(4), ids(6), "b"), sample("b1", ids(4), ids(4), "b")],
    ]


def scorer(teacher: torch.nn.Module, mode: str, top_k: int = 8, **kw) -> TeacherScorer:
    return TeacherScorer(
        DistillConfig(teacher_path="tiny", mode=mode, top_k=top_k), model=teacher, **kw
    )


# ---------------------------------------------------------------- alignment


def test_teacher_targets_from_logits_hand_worked() -> None:
    # one row: sample A = [0, 1, 2] at 0, sample B = [3, 1] at 3; logits are log-probs (lse 0)
    probs = torch.tensor(
        [
            [0.1, 0.2, 0.3, 0.4],
            [0.5, 0.1, 0.3, 0.1],
            [0.25, 0.25, 0.25, 0.25],  # predicts past A's end: never read
            [0.2, 0.6, 0.1, 0.1],
            [0.7, 0.1, 0.1, 0.1],  # predicts past B's end: never read
        ]
    )
    logits, ids, starts = probs.log(), torch.tensor([0, 1, 2, 3, 1]), torch.tensor([0, 3])
    t_ids, t_lps = teacher_targets_from_logits(logits, ids, starts, "topk", 2)
    assert t_ids.tolist() == [[0, 0], [3, 2], [0, 2], [3, 3], [1, 0]]
    expected = [[0.0, 0.0], [0.4, 0.3], [0.5, 0.3], [0.0, 0.0], [0.6, 0.2]]
    expected = [[math.log(p) if p else 0.0 for p in row] for row in expected]
    torch.testing.assert_close(t_lps, torch.tensor(expected), atol=1e-6, rtol=0)

    s_ids, s_lps = teacher_targets_from_logits(logits, ids, starts, "sampled", 2)
    assert s_ids.tolist() == [[0], [1], [2], [3], [1]]  # token_ids repeats input_ids
    expected = [0.0, math.log(0.2), math.log(0.3), 0.0, math.log(0.6)]
    assert s_lps[:, 0].tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("mode", ["topk", "sampled"])
def test_annotate_packed_equals_each_sequence_alone(mode: str) -> None:
    teacher = tiny_qwen2(1)
    groups = groups_of()
    groups[1][1].status = Status.FAILED  # left alone
    # max_tokens 20: several rows, several samples in a row
    scorer(teacher, mode, top_k=5, max_tokens=20).annotate(groups)
    assert groups[1][1].teacher_targets is None
    for s in [groups[0][0], groups[0][1], groups[1][0]]:
        tt = s.teacher_targets
        assert tt is not None and tt.kind == mode and len(tt.token_ids) == len(s.input_ids)
        with torch.no_grad():
            lp = torch.log_softmax(teacher(torch.tensor(s.input_ids)[None]).logits[0], -1)  # [T, V]
        ids = torch.tensor(tt.token_ids)  # [T, K]
        assert ids[0].tolist() == [int(s.input_ids[0])] * ids.shape[1]  # placeholder
        want = lp[:-1].gather(-1, ids[1:])  # [T - 1, K], logits at t - 1 describe token t
        lps = torch.tensor(tt.logprobs, dtype=torch.float32)  # [T, K]
        torch.testing.assert_close(lps[1:], want, atol=1e-5, rtol=0)
        if mode == "sampled":
            assert ids[:, 0].tolist() == s.input_ids.tolist()
        else:
            # the top 5's logprobs hold anywhere; which ids, in which order, only where no
            # near-tie lets the packed forward's last bits decide them
            top = lp[:-1].topk(5, dim=-1)  # [T - 1, 5]
            torch.testing.assert_close(lps[1:], top.values, atol=1e-5, rtol=0)
            clear = top_gaps(lp[:-1], k=5) >= MARGIN  # [T - 1]
            assert clear.sum() >= len(clear) // 2, "a fixture of near-ties checks nothing"
            assert torch.equal(ids[1:][clear], top.indices[clear])


def test_after_the_shift_a_pack_carries_the_teachers_logprob_of_each_target() -> None:
    teacher = tiny_qwen2(1)
    groups = groups_of()
    scorer(teacher, "sampled").annotate(groups)
    cfg = ConversionConfig(pack_max_length=20, task_adv_weight={TASK: 0.0})
    batch = convert_groups(groups, cfg)
    assert len(batch.packs) > 1
    for pack in batch.packs:
        mask = pack.targets != IGNORE_INDEX
        assert pack.teacher_kind == "sampled"
        assert torch.equal(pack.teacher_token_ids[:, 0][mask], pack.targets[mask])
        with torch.no_grad():
            want = forward_logprobs(teacher, pack, 1.0, False)[0]  # [N] teacher on the pack
        assert pack.teacher_logprobs[:, 0][mask].tolist() == pytest.approx(
            want[mask].tolist(), abs=1e-5
        )


# ---------------------------------------------------------------- losses by hand


def test_reverse_kl_sampled_value_is_the_kl_gradient_the_policy_gradient() -> None:
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    term = reverse_kl_sampled(logp, torch.tensor([-1.5, -1.0]))
    assert term.kl.tolist() == pytest.approx([0.5, -1.0])
    assert term.loss.tolist() == pytest.approx([0.5, -1.0])
    term.loss.sum().backward()
    # d/dlogp = (logp_s - logp_t): push down where the student is more sure than the teacher
    assert logp.grad.tolist() == pytest.approx([0.5, -1.0])


def test_forward_kl_topk_renormalises_the_teacher() -> None:
    teacher = torch.tensor([[0.5, 0.25]]).log()  # renormalised: q = [2/3, 1/3]
    student = torch.tensor([[0.25, 0.25]]).log().requires_grad_(True)
    term = forward_kl_topk(student, teacher)
    want = 2 / 3 * math.log((2 / 3) / 0.25) + 1 / 3 * math.log((1 / 3) / 0.25)
    assert term.loss.item() == pytest.approx(want, abs=1e-6)
    term.loss.sum().backward()
    torch.testing.assert_close(student.grad, torch.tensor([[-2 / 3, -1 / 3]]), atol=1e-6, rtol=0)
    at_q = forward_kl_topk(torch.tensor([[2 / 3, 1 / 3]]).log(), teacher)
    assert at_q.loss.item() == pytest.approx(0.0, abs=1e-6)


def test_sampled_targets_of_other_tokens_are_an_error() -> None:
    pack = Pack(
        input_ids=torch.tensor([1, 2, 3]),
        targets=torch.tensor([IGNORE_INDEX, 3, 4]),
        advantages=torch.zeros(3),
        rollout_logprobs=torch.zeros(3),
        has_rollout_logprobs=torch.ones(3, dtype=torch.bool),
        position_ids=torch.arange(3),
        cu_seq_lens=torch.tensor([0, 3], dtype=torch.int32),
        max_seq_len=3,
        sample_index=[0],
        teacher_token_ids=torch.tensor([[9], [3], [5]]),  # 5 != target 4
        teacher_logprobs=torch.full((3, 1), -1.0),
        teacher_kind="sampled",
    )
    with pytest.raises(ValueError, match="differ from the trained tokens"):
        distill_term(pack, torch.zeros(3), None, pack.targets != IGNORE_INDEX)


# ---------------------------------------------------------------- configuration errors


def _tok(vocab: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(get_vocab=lambda: dict(vocab), eos_token_id=1, pad_token_id=0)


def test_tokenizer_mismatch_names_both_paths() -> None:
    check_same_tokenizer(_tok({"a": 0, "b": 1}), "t", _tok({"a": 0, "b": 1}), "s")
    with pytest.raises(ValueError, match=r"'/ckpt/teacher'.*'/ckpt/student'.*different"):
        TeacherScorer(
            DistillConfig(teacher_path="/ckpt/teacher"),
            model=tiny_qwen2(0),
            tokenizer=_tok({"a": 0, "b": 1}),
            student_tokenizer=_tok({"a": 0, "c": 1}),
            student_path="/ckpt/student",
        )


def test_a_top_k_beyond_the_teachers_vocabulary_names_the_field() -> None:
    # distill.mode, top_k >= 1 and coef are the recipe loader's (config/checks.py)
    cfg = DistillConfig(teacher_path="t", top_k=VOCAB + 1)
    with pytest.raises(ValueError, match="exceeds the teacher's vocabulary"):
        TeacherScorer(cfg, model=tiny_qwen2(0))


# ---------------------------------------------------------------- the update


def mean_gap(student: torch.nn.Module, packs: list[Pack]) -> float:
    """How far the student is from the teacher on the packs, token mean, no grad.

    topk: the forward KL over the teacher's top-k. sampled: the squared logprob gap
    (logp_s - logp_t)^2 of each token, since the tokens here are fixed, not the
    student's own samples, so the mean of logp_s - logp_t estimates no KL; the
    update pulls each token's logp_s toward logp_t, shrinking every gap.
    """
    total, tokens = 0.0, 0
    with torch.no_grad():
        for pack in packs:
            mask = pack.targets != IGNORE_INDEX
            logp, _, student_K = forward_logprobs_distill(student, pack, 1.0, False)
            kl = distill_term(pack, logp, student_K, mask).kl  # [N]
            gap = kl if pack.teacher_kind == "topk" else kl.square()
            total += float(gap[mask].sum())
            tokens += int(mask.sum())
    return total / tokens


def distill_step(
    mode: str, coef: float, lr: float
) -> tuple[torch.nn.Module, dict, float, float, dict]:
    """Annotate with a tiny teacher, convert with task_adv_weight 0, one SGD update of a student.

    Plain gradient descent, so a small enough step must lower the loss it descends:
    the top-k forward KL, and for sampled the squared gaps (on fixed tokens, the
    gradient k * grad logp_s of the reverse-KL loss is exactly grad k^2 / 2).
    """
    student, teacher = tiny_qwen2(0), tiny_qwen2(1)
    groups = groups_of()
    scorer(teacher, mode, top_k=8).annotate(groups)
    batch = convert_groups(groups, ConversionConfig(pack_max_length=32, task_adv_weight={TASK: 0}))
    assert all(float(p.advantages.abs().max()) == 0.0 for p in batch.packs)
    before_weights = copy.deepcopy(student.state_dict())
    opt = torch.optim.SGD(student.parameters(), lr=lr)
    updater = PolicyUpdater(
        student,
        opt,
        build_scheduler(opt, OptimizerConfig(lr=lr), 10),
        AlgorithmConfig(),
        distill=DistillConfig(teacher_path="tiny", mode=mode, coef=coef),
    )
    before = mean_gap(student, batch.packs)
    metrics = updater.step(batch.packs)
    return student, metrics, before, mean_gap(student, batch.packs), before_weights


@pytest.mark.parametrize(("mode", "lr", "ratio"), [("topk", 1.0, 0.95), ("sampled", 0.1, 0.6)])
def test_task_weight_zero_trains_on_the_teacher_alone(mode: str, lr: float, ratio: float) -> None:
    _, metrics, before, after, _ = distill_step(mode, coef=1.0, lr=lr)
    assert metrics["actor/pg_loss"] == 0.0  # advantages are 0
    assert metrics["actor/grad_norm"] > 0
    if mode == "topk":
        assert before > 0.1  # two different random models
        assert metrics["actor/distill_kl"] == pytest.approx(before, rel=1e-4)
        assert metrics["actor/distill_loss"] == pytest.approx(before, rel=1e-4)  # token-mean
    # one step moves the student's logprobs toward the teacher's (measured: x0.90, x0.46)
    assert after < ratio * before, (before, after)


def test_distill_coef_zero_with_zero_advantages_moves_nothing() -> None:
    student, metrics, before, after, weights = distill_step("topk", coef=0.0, lr=1.0)
    assert metrics["actor/grad_norm"] == 0.0
    assert after == pytest.approx(before, abs=1e-7)
    for name, value in student.state_dict().items():
        assert torch.equal(value, weights[name]), name
