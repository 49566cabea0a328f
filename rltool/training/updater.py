"""One policy update (train step) from a list of packed rows.

The packs are trained exactly as conversion laid them out (plain or shared-prefix
rows, ``rltool.training.layout``); the updater never re-packs. A train step is::

    old_logp = logp under the current weights, no grad    (skipped if on-policy, below)
    ref_logp = logp under the frozen reference, no grad   (only when kl_coef > 0)
    split the packs into `mini_batches` groups, balanced by loss tokens
        (a pack is never split: with fewer packs than mini_batches, fewer optimizer
        steps; `actor/optimizer_steps` reports how many ran)
    for epoch in ppo_epochs:
        for mini-batch in groups:
            for pack in mini-batch:          one pack = one micro-batch
                forward, loss (losses.py, global denominators), backward
            clip the grad norm, optimizer.step, zero_grad
    scheduler.step                           once: the schedule counts train steps

With one epoch and one mini-batch the weights cannot change between sampling
``old`` and the only forward, so ``old_logp = logp.detach()`` exactly and the
extra no-grad forward is skipped. Forwards run with dropout off (``eval()``) so
that recompute and training forward score the same function; the caller's mode
is restored afterwards.
"""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

from rltool import metric_names as mn
from rltool.config.correction import resolve_correction
from rltool.config.schema import AlgorithmConfig, DistillConfig
from rltool.models import model_device
from rltool.rollout.state import IGNORE_INDEX
from rltool.training.batch import Pack
from rltool.training.compiled import CompiledLayers
from rltool.training.distill import distill_term, forward_logprobs_distill
from rltool.training.logprobs import check_attention, forward_logprobs
from rltool.training.losses import (
    aggregate,
    count_tokens_and_seqs,
    kl_penalty,
)
from rltool.training.policy_losses import LossInputs, build_policy_loss
from rltool.training.rollout_correction import (
    OPSM_FRAC,
    OPSM_SEQ_FRAC,
    RowCorrection,
    batch_norm_factor,
    correct_row,
    mismatch_metrics,
    opsm_keep,
)
from rltool.training.routing_replay import RoutingReplay
from rltool.training.sharding import Shard, full_tensor, gather_objects, rank_slots, reduce_sums


def split_mini_batches(sizes: list[int], n: int) -> list[list[int]]:
    """Pack indices in ``n`` groups of near-equal total size (largest first, to the lightest).

    Fewer groups when there are fewer packs than ``n``; indices keep row order.
    """
    groups: list[list[int]] = [[] for _ in range(min(n, len(sizes)))]
    totals = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = totals.index(min(totals))
        groups[g].append(i)
        totals[g] += sizes[i]
    return [sorted(g) for g in groups]


@contextmanager
def _dropout_off(*models: torch.nn.Module | None):
    modes = [(m, m.training) for m in models if m is not None]
    for m, _ in modes:
        m.eval()
    try:
        yield
    finally:
        for m, was_training in modes:
            m.train(was_training)


class PolicyUpdater:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        algo: AlgorithmConfig,
        grad_clip: float | None = None,
        ref_model: torch.nn.Module | None = None,
        temperature: float = 1.0,
        norm_len: int | None = None,
        distill: DistillConfig | None = None,
        shard: Shard | None = None,
        compile: str = "off",
    ) -> None:
        """``norm_len``: the constant of ``seq-mean-token-sum-norm`` (max response tokens).
        ``distill``: its ``coef`` weighs the distillation loss of packs that carry teacher
        targets (default 1.0). ``shard``: the data-parallel group of an FSDP2 ``model``;
        every rank calls ``step`` with the same packs and trains its token-balanced share.
        ``compile``: ``layers`` runs the step's forwards with compiled decoder layers
        (trainer.compile, training/compiled.py)."""
        if algo.loss_agg == "seq-mean-token-sum-norm" and not norm_len:
            raise ValueError(
                "algorithm.loss_agg 'seq-mean-token-sum-norm' needs norm_len "
                "(pass rollout.sampling.max_new_tokens to PolicyUpdater)"
            )
        if algo.kl_coef > 0 and ref_model is None:
            raise ValueError("algorithm.kl_coef > 0 needs a reference model (ref_model)")
        # the algorithm's values were checked when the recipe loaded (config/checks.py)
        assert temperature > 0, temperature
        self.correction = resolve_correction(algo)  # weights and rejection (rollout_correction.py)
        self._norm = 1.0  # this step's batch-normalisation factor of the weights
        self.policy_loss = build_policy_loss(algo)  # algorithm.policy_loss, its settings bound
        self.distill = distill or DistillConfig()
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.algo, self.ref_model = algo, ref_model
        self.grad_clip = grad_clip if grad_clip and grad_clip > 0 else math.inf
        self.temperature, self.norm_len = temperature, norm_len
        self.shard = shard
        # MoE policies: replay (algorithm.routing_replay) and the mismatch metric
        self.routing = RoutingReplay.for_models(model, ref_model, algo.routing_replay)
        self.compiled = CompiledLayers(model) if compile == "layers" else None

    def step(self, packs: list[Pack]) -> dict[str, float]:
        """One train step over every pack; returns ``actor/*`` metrics."""
        if not packs:
            raise ValueError("PolicyUpdater.step needs at least one pack")
        check_attention(self.model, packs)  # the kernels conversion chose
        if self.routing is not None:
            self.routing.start_step()
        compiled = self.compiled.active() if self.compiled is not None else nullcontext()
        with _dropout_off(self.model, self.ref_model), compiled:
            metrics = self._step(packs)
        return metrics | (self.routing.metrics() if self.routing is not None else {})

    def _routed(self, model: torch.nn.Module, pack: Pack, index: int):
        """The forward's routing: replayed or compared on an MoE model (routing_replay.py)."""
        if self.routing is None:
            return nullcontext()
        return self.routing.forward(model, pack, index)

    def _logprobs_no_grad(
        self, model: torch.nn.Module, packs: list[Pack], rows: list[int]
    ) -> dict[int, torch.Tensor]:
        out = {}
        with torch.no_grad():
            for i in rows:
                with self._routed(model, packs[i], i):
                    out[i] = forward_logprobs(model, packs[i], self.temperature, False)[0]
        return out

    def _slots(self, group: list[int], counts: list[tuple[int, int]]) -> list[tuple[int, bool]]:
        """(row, live) this process trains of a mini-batch: all of it alone; under a shard,
        its token-balanced share padded to the same count as every other rank's."""
        if self.shard is None:
            return [(i, True) for i in group]
        buckets = split_mini_batches([counts[i][0] for i in group], self.shard.world_size)
        return [(group[i], live) for i, live in rank_slots(buckets, self.shard)]

    def _step(self, packs: list[Pack]) -> dict[str, float]:
        algo = self.algo
        device = self.shard.device if self.shard is not None else model_device(self.model)
        masks = [(p.targets != IGNORE_INDEX).to(device) for p in packs]  # [N] each
        counts = [count_tokens_and_seqs(p.targets != IGNORE_INDEX, p.cu_seq_lens) for p in packs]
        groups = split_mini_batches([c[0] for c in counts], algo.mini_batches)
        slots = [self._slots(group, counts) for group in groups]
        rows = [i for group_slots in slots for i, _ in group_slots]  # forwards, in order
        # the loss is normalised over the whole step; FSDP averages gradients over ranks
        scale = 1.0 if self.shard is None else float(self.shard.world_size)
        on_policy = algo.ppo_epochs * len(groups) == 1
        spec = self.correction
        # old for every row before the loop; on-policy only when batch-normalised weights need
        # the whole step's weights first (otherwise each row's correction comes with its forward)
        need_old = not on_policy or (spec.batch_normalize and spec.weights is not None)
        old = self._logprobs_no_grad(self.model, packs, rows) if need_old else None
        live_rows = sorted({i for group_slots in slots for i, live in group_slots if live})
        corr = {i: self._correct(packs[i], old[i]) for i in live_rows} if old is not None else {}
        self._norm = 1.0
        if spec.batch_normalize:
            self._norm = batch_norm_factor(self._gathered(corr), spec.weights)
        ref = self._logprobs_no_grad(self.ref_model, packs, rows) if algo.kl_coef > 0 else None
        lr = float(self.optimizer.param_groups[0]["lr"])
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=device))
        grad_norms: list[float] = []
        for _ in range(algo.ppo_epochs):
            for group, group_slots in zip(groups, slots, strict=True):
                num_tokens = sum(counts[i][0] for i in group)
                num_seqs = sum(counts[i][1] for i in group)
                for i, live in group_slots:
                    old_i = old[i] if old is not None else None
                    ref_i = ref[i] if ref is not None else None
                    # a padding slot (live False) has no active token: zero loss and gradient
                    mask = masks[i] if live else torch.zeros_like(masks[i])
                    into = sums if live else defaultdict(lambda: torch.zeros((), device=device))
                    with self._routed(self.model, packs[i], i):
                        loss = self._micro_loss(
                            packs[i], mask, old_i, ref_i, num_tokens, num_seqs, into,
                            corr if live else {}, i,
                        )  # fmt: skip
                    (loss * scale if scale != 1.0 else loss).backward()
                grad_norms.append(self._optimizer_step())
        self.scheduler.step()
        if self.shard is not None:
            sums = reduce_sums(sums, self.shard)
        mismatch = mismatch_metrics(self._gathered(corr), spec, self._norm)
        return self._metrics(sums, grad_norms, lr, algo.ppo_epochs * len(groups)) | mismatch

    def _correct(self, pack: Pack, old: torch.Tensor) -> RowCorrection:
        device = old.device
        mask = pack.targets.to(device) != IGNORE_INDEX  # [N]
        return correct_row(
            old, pack.rollout_logprobs.to(device), mask, pack.has_rollout_logprobs.to(device),
            pack.cu_seq_lens.to(device), self.correction,
        )  # fmt: skip

    def _gathered(self, corr: dict[int, RowCorrection]) -> list[RowCorrection]:
        """Every rank's row corrections, in row order (each rank corrected its own rows)."""
        if self.shard is None:
            return [corr[i] for i in sorted(corr)]
        parts = gather_objects({i: c.cpu() for i, c in corr.items()}, self.shard)
        merged = {i: c for part in parts for i, c in part.items()}
        return [merged[i] for i in sorted(merged)]

    def _micro_loss(
        self,
        pack: Pack,
        mask: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        num_tokens: int,
        num_seqs: int,
        sums: dict[str, torch.Tensor],
        corr: dict[int, RowCorrection],
        row: int,
    ) -> torch.Tensor:
        """This pack's share of the mini-batch loss; adds token sums of the metrics to ``sums``.
        ``corr``: the rows' rollout corrections; this row's is added when missing (on-policy)."""
        algo, device = self.algo, mask.device
        # student_K: the student's logprobs at a top-k pack's teacher ids, else None
        logp, entropy, student_K = forward_logprobs_distill(
            self.model, pack, self.temperature, entropy_grad=algo.entropy_coef > 0
        )
        old = logp.detach() if old is None else old  # [N]
        advantages = pack.advantages.to(device)  # [N]
        rollout = pack.rollout_logprobs.to(device)  # [N]
        has_rollout = pack.has_rollout_logprobs.to(device)  # [N], from conversion
        if row not in corr and mask.any():  # padding slots (mask all off) are not corrected
            corr[row] = self._correct(pack, old)
        weight, keep = self._weight_and_keep(pack, corr.get(row), logp, mask, sums)  # [N] each
        cu_seq_lens = pack.cu_seq_lens.to(device)  # [S + 1]
        # the loss sees verl's modified mask (sequence-level losses average over kept tokens);
        # the aggregation below still counts every supervised token
        loss_mask = mask if keep is None else mask & keep  # [N]
        pl = self.policy_loss(LossInputs(logp, old, advantages, loss_mask, cu_seq_lens, weight))
        pg = pl.pg  # [N], weighted

        def agg(x: torch.Tensor) -> torch.Tensor:
            # a rejected token leaves the loss, not the counts the aggregation divides by
            x = x if keep is None else torch.where(keep, x, torch.zeros_like(x))
            return aggregate(
                x, mask, pack.cu_seq_lens.to(device), algo.loss_agg, num_tokens, num_seqs,
                self.norm_len,
            )  # fmt: skip

        pg_loss = agg(pg)
        loss = pg_loss
        if ref is not None:
            kl = kl_penalty(logp, ref, algo.kl_estimator)  # [N]
            loss = loss + algo.kl_coef * agg(kl)
            sums["kl"] += kl.detach()[mask].sum()
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * agg(entropy)
        if pack.teacher_kind is not None:  # on-policy distillation (training/distill.py)
            term = distill_term(pack, logp, student_K, mask)
            distill_loss = agg(term.loss)
            loss = loss + self.distill.coef * distill_loss
            sums["distill_loss"] += distill_loss.detach()
            sums["distill_kl"] += term.kl[mask].sum()
        live = has_rollout & mask  # [N]
        sums["pg_loss"] += pg_loss.detach()
        sums["tokens"] += mask.sum()
        sums["entropy"] += entropy.detach()[mask].sum()
        sums["clip_frac"] += pl.clipped[mask].sum()
        sums["ratio"] += pl.ratio[mask].sum()
        sums["approx_kl_old"] += kl_penalty(logp.detach(), old, "k3")[mask].sum()
        sums["rollout_kl"] += kl_penalty(old, rollout, "k3")[live].sum()
        sums["rollout_tokens"] += live.sum()
        return loss

    def _weight_and_keep(
        self,
        pack: Pack,
        rc: RowCorrection | None,
        logp: torch.Tensor,
        mask: torch.Tensor,
        sums: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This row's IS weight [N] (None: no weights) and keep mask [N] (None: nothing
        rejected), OPSM included (it compares old with the current logp)."""
        spec = self.correction
        if rc is None:  # no supervised token in this slot
            return None, None
        weight = None
        if spec.weights is not None:
            weight = rc.weight  # [N]; batch-normalised on eligible tokens only
            if self._norm != 1.0:
                weight = torch.where(rc.eligible, weight / self._norm, weight)
            sums["tis_weight"] += weight[mask].sum()
        keep = rc.keep if spec.reject else None
        if spec.opsm_delta is not None:
            kept = opsm_keep(
                rc.old, logp, pack.advantages.to(logp.device), rc.eligible,
                pack.cu_seq_lens.to(logp.device), spec.opsm_delta,
            )  # fmt: skip
            dropped = ~kept & rc.eligible  # [N]
            n_S = torch.bincount(rc.seq[rc.eligible], minlength=rc.num_samples + 1)
            d_S = torch.bincount(rc.seq[dropped], minlength=rc.num_samples + 1)
            sums["opsm_dropped"] += dropped.sum()
            sums["opsm_tokens"] += rc.eligible.sum()
            sums["opsm_dropped_seqs"] += (d_S > 0).sum()
            sums["opsm_seqs"] += (n_S > 0).sum()
            keep = kept if keep is None else keep & kept
        return weight, keep

    def _optimizer_step(self) -> float:
        """Clip, step, zero; a non-finite gradient skips the step (reported as nan norm)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, self.grad_clip)))
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _metrics(
        self, sums: dict[str, torch.Tensor], grad_norms: list[float], lr: float, n_steps: int
    ) -> dict[str, float]:
        s = {k: float(v) for k, v in sums.items()}
        tokens = max(s["tokens"], 1.0)
        distill = {}
        if "distill_loss" in s:  # some pack carried teacher targets
            distill = {
                "actor/distill_loss": s["distill_loss"] / n_steps,
                "actor/distill_kl": s["distill_kl"] / tokens,
            }
        if "opsm_tokens" in s:  # averaged over every update of the step
            distill[OPSM_FRAC] = s["opsm_dropped"] / max(s["opsm_tokens"], 1.0)
            distill[OPSM_SEQ_FRAC] = s["opsm_dropped_seqs"] / max(s["opsm_seqs"], 1.0)
        return {
            "actor/pg_loss": s["pg_loss"] / n_steps,
            mn.ACTOR_KL: s.get("kl", 0.0) / tokens,
            mn.ACTOR_ENTROPY: s["entropy"] / tokens,
            mn.ACTOR_CLIP_FRAC: s["clip_frac"] / tokens,
            "actor/ratio_mean": s["ratio"] / tokens,
            "actor/tis_weight_mean": s.get("tis_weight", tokens) / tokens,
            mn.ACTOR_ROLLOUT_KL: s["rollout_kl"] / max(s["rollout_tokens"], 1.0),
            "actor/approx_kl_old": s["approx_kl_old"] / tokens,
            mn.ACTOR_GRAD_NORM: sum(grad_norms) / len(grad_norms),
            "actor/skipped_steps": float(sum(not math.isfinite(g) for g in grad_norms)),
            "actor/optimizer_steps": float(n_steps),
            "actor/lr": lr,
        } | distill
