"""The trainer's logprobs of a converted batch, recomputed with a given model (``rltool
inspect-batch --model``), and where MoE routing the model picks disagrees with the recorded.

The forward is the updater's own (``forward_logprobs`` on each packed row, at the sampling
temperature), so the logprob shown is the ``old_logp`` the loss would compare with the
rollout's; the correction's weights and rejection are the updater's too
(``rollout_correction.correct_row`` on those logprobs). With ``replay`` the recorded
experts route the forward (as ``algorithm.routing_replay`` does in training); the
disagreement is always measured on a forward where the model routes by itself: per position
and MoE layer, whether the router's top-k set differs from the recorded one.

Shape legend: N = positions of a packed row, L = MoE layers, k = experts per token.
Design: docs/inspect.md#where-the-mismatch-lives
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rltool.config.correction import CorrectionSpec
from rltool.moe import Routers, find_routers, recording, replaying
from rltool.rollout.routing import NOT_ROUTED
from rltool.rollout.state import IGNORE_INDEX
from rltool.training.batch import Pack
from rltool.training.logprobs import check_attention, forward_logprobs
from rltool.training.rollout_correction import batch_norm_factor, correct_row


@dataclass(slots=True)
class PackRecompute:
    """What the model says about one packed row."""

    logprobs: np.ndarray  # [N] float64, trainer logprob of each target, 0.0 where -100
    # [N, L] bool: the router's own top-k differs from the recorded experts at that layer
    # (False where the row was never routed); None for a dense model or a row without routing
    routing_differs: np.ndarray | None = None
    weights: np.ndarray | None = None  # [N] the correction's IS weight; None: no weights
    masked: np.ndarray | None = None  # [N] bool, a rejection criterion drops the token


def routing_disagreement(own: torch.Tensor, recorded: torch.Tensor) -> np.ndarray:
    """[N, L] bool: per position and layer, the chosen expert sets differ; positions whose
    recorded row is NOT_ROUTED never differ. ``own``, ``recorded``: [N, L, k]."""
    fed = (recorded != NOT_ROUTED).all(-1)  # [N, L]
    same = (own.sort(-1).values == recorded.sort(-1).values).all(-1)  # [N, L]
    return (~same & fed).numpy()


def _own_routing(model: torch.nn.Module, routers: Routers, pack: Pack) -> torch.Tensor:
    """The experts the model's routers pick by themselves over the row, [N, L, k]."""
    with recording(model, routers) as seen:
        forward_logprobs(model, pack, 1.0, False)
    return seen[0][0].cpu()  # the one [1, N, L, k] forward


def recompute_packs(
    model: torch.nn.Module, packs: list[Pack], temperature: float, replay: bool = False
) -> list[PackRecompute]:
    """Per pack, the trainer's logprobs (no gradient) and the routing disagreement. Raises
    ValueError when the rows need a kernel the model cannot run, or when ``replay`` is asked
    of a dense model or of rows that carry no routing."""
    check_attention(model, packs)
    routers = find_routers(model, "--replay-routing" if replay else None)
    out = []
    with torch.no_grad():
        for i, pack in enumerate(packs):
            recorded = pack.routed_experts  # [N, L, k] or None
            if routers is None or recorded is None:
                if replay:
                    raise ValueError(f"pack {i} carries no routed_experts to replay")
                logp = forward_logprobs(model, pack, temperature, False)[0]  # [N]
                out.append(PackRecompute(logp.double().cpu().numpy()))
                continue
            if replay:
                with replaying(model, routers, recorded, replay=True):
                    logp = forward_logprobs(model, pack, temperature, False)[0]  # [N]
                own = _own_routing(model, routers, pack)  # [N, L, k]
            else:
                with recording(model, routers) as seen:
                    logp = forward_logprobs(model, pack, temperature, False)[0]  # [N]
                own = seen[0][0].cpu()  # [N, L, k]
            differs = routing_disagreement(own, recorded.cpu())  # [N, L]
            out.append(PackRecompute(logp.double().cpu().numpy(), differs))
    return out


def correct_packs(packs: list[Pack], recomputed: list[PackRecompute], spec: CorrectionSpec) -> None:
    """Fill each PackRecompute's ``weights`` and ``masked`` as the updater's correction makes
    them from these old logprobs (``rollout_correction.correct_row``), weights divided by
    the batch-normalisation factor over the given packs (pass every pack of the step when
    ``spec.batch_normalize``). OPSM is not shown: it compares with the current logprobs,
    which equal the old ones on the first update, where it drops nothing."""
    rows = []
    for pack, rec in zip(packs, recomputed, strict=True):
        old = torch.from_numpy(rec.logprobs).float()  # [N]
        mask = pack.targets != IGNORE_INDEX  # [N]
        rows.append(
            correct_row(
                old, pack.rollout_logprobs, mask, pack.has_rollout_logprobs, pack.cu_seq_lens, spec
            )
        )
    norm = batch_norm_factor(rows, spec.weights) if spec.batch_normalize else 1.0
    for rc, rec in zip(rows, recomputed, strict=True):
        if spec.weights is not None:
            weight = torch.where(rc.eligible, rc.weight / norm, rc.weight)  # [N]
            rec.weights = weight.double().numpy()
        if spec.reject:
            rec.masked = (~rc.keep & rc.eligible).numpy()  # [N]
