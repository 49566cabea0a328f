"""On-policy distillation at training time: the losses on the teacher's targets.

Shape legend: N = tokens in one Pack, V = vocabulary, K = top-k width.

``rltool.produce.teacher`` writes ``teacher_targets`` at production time; after the
conversion's one shift, Pack position j carries ``teacher_targets[j + 1]``, the
teacher's prediction of target j from the same prefix the student's logits at j see.

Both losses work per supervised target (``targets != -100``), are aggregated by
the recipe's ``loss_agg`` like the policy loss, and enter as
``loss = policy loss + distill.coef * distill loss``. With
``algorithm.task_adv_weight.<task>: 0`` the advantages are 0, the policy term
vanishes and the teacher signal alone trains the student.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltool.config.checks import NAMES
from rltool.models import model_device
from rltool.training.batch import Pack
from rltool.training.logprobs import (
    _entropy_no_grad,
    entropy_from_logits,
    forward_logprobs,
    packed_logits,
    token_logprobs,
)


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
    assert pack.teacher_logprobs is not None and pack.teacher_kind in NAMES["distill.mode"].names
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
