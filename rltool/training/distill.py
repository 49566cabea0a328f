"""On-policy distillation: a teacher scores the student's own samples; the losses that use it.

Shape legend: T = len(input_ids) of one sample, N = tokens in one row (a packed
row of the teacher's forward, or a trainer Pack), V = vocabulary, K = top-k width.

The student samples as usual; before the groups reach the replay buffer the
``TeacherScorer`` runs one no-grad forward of the teacher over every COMPLETED
sample and writes ``teacher_targets``. Like every per-position field they are
unshifted (data contract section 2): position t describes the token AT t,
``input_ids[t]``, exactly as ``logprobs[t]`` does, so it is read from the
teacher's logits at t - 1 (which predict token t)::

    input_ids        [ a,    b,       c,       d      ]
    teacher logits     z0    z1       z2       (z3 predicts past the end: unused)
    teacher_targets  [ -- , f(z0),   f(z1),   f(z2)   ]    f = top-k, or logp of the token

Position 0 has nothing before it; it holds a placeholder (``input_ids[0]`` in
every column, logprob 0.0) and is never read: the conversion's one shift drops
position 0 of every per-position field along with the first label. After that
shift, Pack position j carries ``teacher_targets[j + 1]``, the teacher's
prediction of target j from the same prefix the student's logits at j see.

Both losses work per supervised target (``targets != -100``), are aggregated by
the recipe's ``loss_agg`` like the policy loss, and enter as
``loss = policy loss + distill.coef * distill loss``. With
``algorithm.task_adv_weight.<task>: 0`` the advantages are 0, the policy term
vanishes and the teacher signal alone trains the student.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rltool.config.schema import DistillConfig, ModelConfig
from rltool.models import load_model_and_tokenizer
from rltool.rollout.state import RolloutState, Status, TeacherTargets
from rltool.training.batch import Pack
from rltool.training.logprobs import (
    _entropy_no_grad,
    entropy_from_logits,
    forward_logprobs,
    model_device,
    packed_logits,
    token_logprobs,
)
from rltool.training.packing import pack_lengths

DISTILL_MODES = ("topk", "sampled")


def check_distill_config(cfg: DistillConfig) -> None:
    """ValueError naming the recipe field for a bad distill section."""
    if cfg.mode not in DISTILL_MODES:
        raise ValueError(f"distill.mode: unknown {cfg.mode!r}; known: {', '.join(DISTILL_MODES)}")
    if cfg.mode == "topk" and cfg.top_k < 1:
        raise ValueError(f"distill.top_k must be >= 1, got {cfg.top_k}")
    if not (math.isfinite(cfg.coef) and cfg.coef >= 0):
        raise ValueError(f"distill.coef must be finite and >= 0, got {cfg.coef}")


def check_same_tokenizer(teacher_tok, teacher_path: str, student_tok, student_path: str) -> None:
    """Token ids mean the same to both models, or a ValueError naming both paths."""
    same = (
        teacher_tok.get_vocab() == student_tok.get_vocab()
        and teacher_tok.eos_token_id == student_tok.eos_token_id
        and teacher_tok.pad_token_id == student_tok.pad_token_id
    )
    if not same:
        raise ValueError(
            f"distill.teacher_path {teacher_path!r} and model.path {student_path!r} have different "
            "tokenizers (vocabulary or special tokens differ); the teacher scores the student's "
            "token ids, so both must share one tokenizer"
        )


# ---------------------------------------------------------------- the teacher


def teacher_targets_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    starts: torch.Tensor,
    kind: str,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [N, K], logprobs [N, K]) of one row, unshifted: row p describes input_ids[p].

    ``logits`` [N, V] are the teacher's (already temperature-scaled) logits of a
    row holding samples back to back; ``starts`` ([S] long) are the samples'
    first positions, which get the placeholder (nothing predicts them).
    """
    logits = logits.float()  # [N, V]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
    if kind == "topk":
        values, ids = logits.topk(top_k, dim=-1)  # [N, K]
        lps = values - lse  # [N, K]
    else:  # sampled: the logprob of the token that follows
        ids = input_ids.roll(-1)[:, None]  # [N, 1], row p: the token at p + 1
        lps = logits.gather(-1, ids) - lse  # [N, 1]
    # row p-1 predicts token p: move everything down one row, placeholders at the starts
    token_ids = ids.roll(1, dims=0)  # [N, K]
    logprobs = lps.roll(1, dims=0)  # [N, K]
    token_ids[starts] = input_ids[starts, None]
    logprobs[starts] = 0.0
    return token_ids, logprobs


class TeacherScorer:
    """The teacher of on-policy distillation: fills ``teacher_targets`` of generated samples.

    ``model``/``tokenizer`` given: use them (tests, or a teacher already loaded);
    otherwise load ``cfg.teacher_path`` with the policy's loader on ``device``
    (default: the recipe's ``auto``). ``student_tokenizer`` given: it must equal
    the teacher's (``check_same_tokenizer``). The teacher scores at temperature
    1, its own distribution; ``max_tokens`` bounds one forward's packed row
    (attention is quadratic in the row length).
    """

    def __init__(
        self,
        cfg: DistillConfig,
        device: str | torch.device | None = None,
        model: torch.nn.Module | None = None,
        tokenizer=None,
        student_tokenizer=None,
        student_path: str = "model.path",
        max_tokens: int = 1024,
    ) -> None:
        check_distill_config(cfg)
        if not cfg.teacher_path and model is None:
            raise ValueError("distill.teacher_path is not set; name the teacher checkpoint")
        if model is None:
            mcfg = ModelConfig(path=cfg.teacher_path, device=str(device or "auto"))
            model, tokenizer, _ = load_model_and_tokenizer(mcfg)
        if student_tokenizer is not None and tokenizer is not None:
            check_same_tokenizer(tokenizer, str(cfg.teacher_path), student_tokenizer, student_path)
        self.cfg, self.tokenizer, self.max_tokens = cfg, tokenizer, max_tokens
        self.model = model.eval().requires_grad_(False)
        vocab = int(self.model.get_input_embeddings().weight.shape[0])
        if cfg.mode == "topk" and cfg.top_k > vocab:
            raise ValueError(f"distill.top_k {cfg.top_k} exceeds the teacher's vocabulary {vocab}")

    def score(self, sequences: Sequence[Sequence[int]]) -> list[TeacherTargets]:
        """Teacher targets of each token sequence (each of length >= 1), in order."""
        lengths = [len(s) for s in sequences]
        rows = pack_lengths(lengths, max(self.max_tokens, *lengths)) if sequences else []
        out: list[TeacherTargets | None] = [None] * len(sequences)
        device = model_device(self.model)
        kind = self.cfg.mode
        for row in rows:
            ids = torch.cat([torch.as_tensor(sequences[i]) for i in row]).to(device)  # [N]
            lens = torch.tensor([lengths[i] for i in row], device=device)  # [S]
            starts = torch.cumsum(lens, 0) - lens  # [S]
            position_ids = torch.arange(len(ids), device=device) - starts.repeat_interleave(lens)
            with torch.no_grad():
                # attention_mask=None + use_cache=False: position_ids restarting per sample
                # keep the samples apart (facts.md); the trainer's forward does the same
                logits = self.model(
                    input_ids=ids[None],  # [1, N]
                    position_ids=position_ids[None],  # [1, N]
                    attention_mask=None,
                    use_cache=False,
                ).logits[0]  # [N, V]
                token_ids, logprobs = teacher_targets_from_logits(
                    logits, ids, starts, kind, self.cfg.top_k
                )  # [N, K] each
            sizes = lens.tolist()
            split = zip(token_ids.split(sizes), logprobs.split(sizes), strict=True)
            for i, (ids_K, lps_K) in zip(row, split, strict=True):
                out[i] = TeacherTargets(
                    kind=kind, token_ids=ids_K.tolist(), logprobs=lps_K.tolist()
                )
        return out  # type: ignore[return-value]  # every index filled: rows cover all samples

    def annotate(self, groups: Sequence[Sequence[RolloutState]]) -> None:
        """Fill ``teacher_targets`` of every COMPLETED sample with input_ids, in place.

        Samples of any other status are left alone: the conversion skips their groups.
        """
        todo = [s for g in groups for s in g if s.status == Status.COMPLETED and s.input_ids]
        for s, targets in zip(todo, self.score([s.input_ids for s in todo]), strict=True):
            s.teacher_targets = targets


# ---------------------------------------------------------------- the losses


@dataclass(slots=True)
class DistillTerm:
    loss: torch.Tensor  # [N] per-token loss to aggregate (differentiable)
    kl: torch.Tensor  # [N] per-token KL estimate, detached (the metric)


def reverse_kl_sampled(logp: torch.Tensor, teacher_logp: torch.Tensor) -> DistillTerm:
    """Reverse KL(student || teacher) on the student's own sampled tokens, policy-gradient form.

    Per token, k = logp_s(y) - logp_t(y) is the one-sample estimate of the
    reverse KL. Its direct gradient is useless: d k / d theta = grad logp_s(y),
    whose expectation under the student's own sampling is exactly 0. The
    gradient of the KL itself is E[k * grad logp_s(y)] (the score-function
    estimator), so the loss is ``k.detach() * exp(logp - logp.detach())``: its
    value is k (the metric reads as the KL), its gradient k * grad logp_s, i.e.
    the policy gradient with a per-token advantage ``-(logp_s - logp_t)`` and no
    credit to earlier tokens (the per-token reward of on-policy distillation).
    It is on-policy: extra PPO epochs reuse it without an importance ratio.
    """
    k = (logp - teacher_logp).detach()  # [N]
    ratio = torch.exp(logp - logp.detach())  # [N], 1 in value
    return DistillTerm(loss=k * ratio, kl=k)


def forward_kl_topk(student_logp_K: torch.Tensor, teacher_logp_K: torch.Tensor) -> DistillTerm:
    """Forward KL(teacher || student) over the teacher's top-k, teacher renormalised over them.

    ``student_logp_K`` [N, K]: the student's full-vocabulary log-softmax at the
    teacher's top-k ids; ``teacher_logp_K`` [N, K] the teacher's. With
    q = the teacher's probabilities renormalised over its top-k::

        loss = sum_k q(k) (log q(k) - log p_s(k))

    Truncating to the top-k makes q the target whether or not it is
    renormalised (the gradient of either vanishes only at p_s = q on the top-k,
    0 elsewhere); renormalised, the value is >= 0 and exactly 0 at that
    minimum (p_s(k) <= its own renormalisation), so the metric reads as a KL.
    """
    log_q = torch.log_softmax(teacher_logp_K.float(), dim=-1)  # [N, K] renormalised
    q = log_q.exp()  # [N, K]
    loss = (q * (log_q - student_logp_K)).sum(-1)  # [N]
    return DistillTerm(loss=loss, kl=loss.detach())


def forward_logprobs_distill(
    model: torch.nn.Module, pack: Pack, temperature: float, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``forward_logprobs`` plus, for a top-k pack, the student's logprobs at the teacher's ids.

    Returns (logp [N], entropy [N], student_logp_K [N, K] or None) from one forward.
    """
    if pack.teacher_kind != "topk":
        logp, entropy = forward_logprobs(model, pack, temperature, True, entropy_grad)
        return logp, entropy, None
    device = model_device(model)
    targets = pack.targets.to(device)  # [N]
    logp, logits = token_logprobs(packed_logits(model, pack), targets, temperature)  # [N, V]
    ids = pack.teacher_token_ids.to(device)  # [N, K]
    student_K = logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, K]
    use_grad = entropy_grad and torch.is_grad_enabled()
    entropy = entropy_from_logits(logits) if use_grad else _entropy_no_grad(logits)  # [N]
    return logp, entropy, student_K


def distill_term(
    pack: Pack, logp: torch.Tensor, student_logp_K: torch.Tensor | None, mask: torch.Tensor
) -> DistillTerm:
    """The per-token distillation loss of a pack carrying teacher targets, by its kind.

    ``mask`` [N] = supervised targets; the teacher values elsewhere (placeholders,
    padding) are zeroed first so that nothing non-finite reaches the gradient.
    """
    assert pack.teacher_logprobs is not None and pack.teacher_kind in DISTILL_MODES
    teacher = pack.teacher_logprobs.to(logp.device).float()  # [N, K]
    teacher = torch.where(mask[:, None], teacher, torch.zeros_like(teacher))  # [N, K]
    if pack.teacher_kind == "sampled":
        t_ids = pack.teacher_token_ids.to(mask.device)[:, 0]  # [N]
        if not bool((t_ids == pack.targets.to(mask.device))[mask].all()):
            raise ValueError(
                "teacher_targets (sampled) token ids differ from the trained tokens: the teacher "
                "scored other sequences than these samples, or the targets are misaligned"
            )
        return reverse_kl_sampled(logp, teacher[:, 0])
    assert student_logp_K is not None, "a top-k pack needs forward_logprobs_distill's student_K"
    student = torch.where(mask[:, None], student_logp_K, torch.zeros_like(student_logp_K))
    return forward_kl_topk(student, teacher)
