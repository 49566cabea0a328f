"""convert_groups against a per-token reference written straight from the data contract.

Builds ``--groups`` groups of 8 samples of about 1k tokens (prompt 100-300, the
rest response, half of the response supervised in spans, the rest environment
output) in the program, as an agent loop does (token fields are numpy arrays),
and the same samples written to a JSONL file and read back with
``rltool.rollout.io.read_groups``. Converts both with
``rltool.training.convert.convert_groups``, and runs ``reference_convert`` below
(plain Python loops over tokens, building lists, ``torch.tensor`` at the end) on
the same samples with their token fields as plain Python lists, as it always ran
(indexing a numpy array one element at a time is slower, which would flatter the
ratio). Checks that each conversion gives the reference's packs on a subset and
its data_info, and prints tokens/s of each, the ratios, the share of the
conversion spent in the contract check, and the packer's padding waste.

Times are CPU seconds of this process, the best of ``--rounds`` interleaved
rounds (each times every contender once), so that other jobs on a shared machine
disturb them less and alike; wall seconds are printed too. The two conversions
take turns running first after the reference: whichever runs first pays for the
memory the reference gave back, about a third more time.

    python benchmarks/convert.py            # 512 groups x 8 samples, pack_max_length 8192
    python benchmarks/convert.py --groups 64
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rltool.packing import pack_lengths
from rltool.rollout.contract import check_samples
from rltool.rollout.io import read_groups, write_rollouts
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status
from rltool.training.batch import Pack, TrainBatch
from rltool.training.convert import ConversionConfig, convert_groups

GROUP_SIZE = 8
VOCAB = 32_000


def _response_labels(rng: np.random.Generator, response: np.ndarray) -> np.ndarray:
    """Alternate supervised and environment spans of 8-64 tokens: about half supervised."""
    labels = np.full(response.size, IGNORE_INDEX, dtype=np.int64)
    pos, supervised = 0, True
    while pos < response.size:
        span = int(rng.integers(8, 65))
        if supervised:
            labels[pos : pos + span] = response[pos : pos + span]
        pos += span
        supervised = not supervised
    return labels


def make_groups(n_groups: int, seed: int = 0) -> list[list[RolloutState]]:
    """Samples built in the program from numpy arrays, as the agent loops build them."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(0, VOCAB, int(rng.integers(100, 301)))
        group = []
        for k in range(GROUP_SIZE):
            total = int(rng.integers(768, 1281))
            response = rng.integers(0, VOCAB, total - prompt.size)
            r_labels = _response_labels(rng, response)
            r_lp = np.where(r_labels != IGNORE_INDEX, -rng.exponential(1.0, response.size), 0.0)
            group.append(
                RolloutState(
                    rollout_id=f"g{g}-{k}",
                    group_id=f"g{g}",
                    prompt_ids=prompt,
                    response_ids=response,
                    input_ids=np.concatenate([prompt, response]),
                    labels=np.concatenate([np.full(prompt.size, IGNORE_INDEX), r_labels]),
                    logprobs=np.concatenate([np.zeros(prompt.size), r_lp]),
                    reward={"score": float(rng.integers(0, 2))},
                    status=Status.COMPLETED,
                )
            )
        groups.append(group)
    return groups


def through_jsonl(groups: list[list[RolloutState]]) -> list[list[RolloutState]]:
    """The groups written to a JSONL file and read back, as a rollout file is."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollouts.jsonl"
        for group in groups:
            write_rollouts(path, group)
        return read_groups(path)


TOKEN_FIELDS = ("prompt_ids", "response_ids", "input_ids", "labels", "logprobs")


def with_lists(s: RolloutState) -> RolloutState:
    """The sample with plain-list token fields: the reference's input, as it always was
    (``model_construct`` skips validation, which would make them arrays)."""
    lists = {k: None if getattr(s, k) is None else getattr(s, k).tolist() for k in TOKEN_FIELDS}
    return RolloutState.model_construct(**{**dict(s), **lists})


# ---------------------------------------------------------------- the reference


def _ref_valid(s: RolloutState) -> bool:
    """Section 4 invariants 1-6, token by token."""
    ids, labels, lps = s.input_ids, s.labels, s.logprobs
    if ids is None or labels is None or len(ids) < 2 or len(labels) != len(ids):
        return False
    p = len(s.prompt_ids)
    for i in range(p):
        if ids[i] != s.prompt_ids[i] or labels[i] != IGNORE_INDEX:
            return False
    for i in range(len(ids) - p):
        if s.response_ids[i] != ids[p + i]:
            return False
    for i in range(len(ids)):
        if labels[i] != IGNORE_INDEX and labels[i] != ids[i]:
            return False
        if lps is not None:
            if not math.isfinite(lps[i]):
                return False
            if labels[i] != IGNORE_INDEX and lps[i] > 1e-4:
                return False
            if labels[i] == IGNORE_INDEX and lps[i] != 0.0:
                return False
    score = None if s.reward is None else s.reward.get("score")
    return score is not None and math.isfinite(score)


def _ref_grpo(group: list[RolloutState]) -> tuple[list[float], list[float]]:
    """Advantage per member and reward per cluster (session_id, else rollout_id)."""
    clusters: dict[str, list[float]] = {}
    for s in group:
        clusters.setdefault(s.session_id or s.rollout_id, []).append(s.reward["score"])
    reward = {k: sum(v) / len(v) for k, v in clusters.items()}
    n = len(reward)
    if n < 2:
        return [0.0] * len(group), list(reward.values())
    mean = sum(reward.values()) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in reward.values()) / (n - 1))
    advs = [(reward[s.session_id or s.rollout_id] - mean) / (std + 1e-6) for s in group]
    return advs, list(reward.values())


def _ref_stats(prefix: str, values: list[float]) -> dict[str, float]:
    return {
        f"{prefix}/mean": sum(values) / len(values),
        f"{prefix}/min": min(values),
        f"{prefix}/max": max(values),
    }


def reference_convert(
    groups: list[list[RolloutState]], max_len: int
) -> tuple[list[Pack], dict[str, float]]:
    """Contract sections 4, 5.1-5.5 for GRPO, token by token: the packs and the data_info."""
    samples, advantages, rewards = [], [], []
    for group in groups:
        if all(s.status == Status.COMPLETED for s in group) and all(_ref_valid(s) for s in group):
            advs, cluster_rewards = _ref_grpo(group)
            samples.extend(group)
            advantages.extend(advs)
            rewards.extend(cluster_rewards)
    shifted, active_advs, response_lens = [], [], []
    for s, adv in zip(samples, advantages, strict=True):
        inputs, targets, lps, advs, supervised = [], [], [], [], 0
        for i in range(len(s.input_ids) - 1):
            inputs.append(s.input_ids[i])
            target = s.labels[i + 1]
            targets.append(target)
            lps.append(s.logprobs[i + 1] if s.logprobs is not None else 0.0)
            if target != IGNORE_INDEX:
                advs.append(adv)
                active_advs.append(adv)
                supervised += 1
            else:
                advs.append(0.0)
        shifted.append((inputs, targets, lps, advs))
        response_lens.append(supervised)
    rows = pack_lengths([len(x[0]) for x in shifted], max_len)
    packs, tokens = [], 0
    for row in rows:
        inputs, targets, lps, advs, positions, cu = [], [], [], [], [], [0]
        has_lps = []
        for k in row:
            has_lps.extend([samples[k].logprobs is not None] * len(shifted[k][0]))
            for j in range(len(shifted[k][0])):
                inputs.append(shifted[k][0][j])
                targets.append(shifted[k][1][j])
                lps.append(shifted[k][2][j])
                advs.append(shifted[k][3][j])
                positions.append(j)
            cu.append(len(inputs))
        tokens += len(inputs)
        packs.append(
            Pack(
                input_ids=torch.tensor(inputs, dtype=torch.long),
                targets=torch.tensor(targets, dtype=torch.long),
                advantages=torch.tensor(advs, dtype=torch.float32),
                rollout_logprobs=torch.tensor(lps, dtype=torch.float32),
                has_rollout_logprobs=torch.tensor(has_lps, dtype=torch.bool),
                position_ids=torch.tensor(positions, dtype=torch.long),
                cu_seq_lens=torch.tensor(cu, dtype=torch.int32),
                max_seq_len=max(len(shifted[k][0]) for k in row),
                sample_index=list(row),
            )
        )
    info = {
        "data/training_samples": float(len(samples)),
        "data/training_tokens": float(tokens),
        "data/supervised_tokens": float(len(active_advs)),
        "data/packs": float(len(packs)),
        "data/padding_waste": 1.0 - tokens / (len(packs) * max_len),
    }
    info |= _ref_stats("data/rewards", rewards)
    info |= _ref_stats("data/advantages", active_advs)
    info |= _ref_stats("data/prompt_len", [float(len(s.prompt_ids)) for s in samples])
    info |= _ref_stats("data/response_len", [float(n) for n in response_lens])
    return packs, info


# ---------------------------------------------------------------- the comparison


def _same(a: Pack, b: Pack) -> bool:
    return (
        a.sample_index == b.sample_index
        and a.max_seq_len == b.max_seq_len
        and all(
            torch.equal(getattr(a, f), getattr(b, f))
            for f in ("input_ids", "targets", "position_ids", "cu_seq_lens", "rollout_logprobs")
        )
        and torch.equal(a.has_rollout_logprobs, b.has_rollout_logprobs)
        and torch.allclose(a.advantages, b.advantages, atol=1e-5)
    )


def _check(groups: list[list[RolloutState]]) -> None:
    """Only the contract check of every sample, as convert_groups screens them."""
    check_samples([s for g in groups for s in g])


@dataclass
class _Timing:
    """Best CPU time (this process only: robust to other jobs on a shared machine) and
    best wall time over the rounds, and the last result."""

    cpu: float = math.inf
    wall: float = math.inf
    out: Any = None

    def run(self, fn: Callable[[], Any]) -> None:
        self.out = None
        gc.collect()  # no run pays for the garbage of the one before
        c0, w0 = time.process_time(), time.perf_counter()
        self.out = fn()
        self.cpu = min(self.cpu, time.process_time() - c0)
        self.wall = min(self.wall, time.perf_counter() - w0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--pack-max-length", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5, help="each round times every contender once")
    ap.add_argument("--check-packs", type=int, default=16, help="packs compared with the reference")
    args = ap.parse_args()

    t0 = time.perf_counter()
    groups = make_groups(args.groups)
    built = time.perf_counter() - t0
    read = through_jsonl(groups)
    listed = [[with_lists(s) for s in g] for g in groups]
    print(
        f"built {args.groups} groups x {GROUP_SIZE} in {built:.1f} s; wrote and read them as "
        f"JSONL in {time.perf_counter() - t0 - built:.1f} s"
    )
    cfg = ConversionConfig(estimator="grpo", pack_max_length=args.pack_max_length)

    # interleaved rounds, so that every contender sees the same load on a shared machine
    ours, from_jsonl, check, ref = _Timing(), _Timing(), _Timing(), _Timing()
    for r in range(args.rounds):
        # the conversion that runs first after the reference pays for the memory the
        # reference gave back (page faults): alternate which one that is
        pair = [(ours, groups), (from_jsonl, read)]
        for timing, gs in pair if r % 2 == 0 else reversed(pair):
            timing.run(lambda gs=gs: convert_groups(gs, cfg))
        check.run(lambda: _check(groups))
        ref.run(lambda: reference_convert(listed, args.pack_max_length))
    batch, ref_packs, ref_info = ours.out, *ref.out

    n_check = min(args.check_packs, len(batch.packs))
    for name, b in (("in-program samples", batch), ("samples read from JSONL", from_jsonl.out)):
        _check_against_reference(name, b, ref_packs, ref_info, n_check)

    tokens = batch.num_tokens
    waste = batch.data_info["data/padding_waste"]
    n_packs, n_keys = len(batch.packs), len(ref_info)
    print(f"tokens (shifted)            {tokens:,} in {n_packs} packs <= {args.pack_max_length}")
    print(f"agree on                    {n_check} of {n_packs} packs, {n_keys} data_info keys")
    print(f"{'':28s}{'cpu s':>8s} {'cpu tokens/s':>14s} {'wall s':>8s} {'wall tokens/s':>14s}")
    for name, t in (
        ("convert_groups, in-program", ours),
        ("convert_groups, from JSONL", from_jsonl),
        ("per-token reference", ref),
    ):
        print(
            f"{name:28s}{t.cpu:8.3f} {tokens / t.cpu:14,.0f} {t.wall:8.3f} {tokens / t.wall:14,.0f}"
        )
    for name, t in (("in-program", ours), ("from JSONL", from_jsonl)):
        print(f"speed-up, {name:18s}{ref.cpu / t.cpu:8.1f}x cpu, {ref.wall / t.wall:.1f}x wall")
    print(f"contract check alone        {check.cpu:8.3f} s = {check.cpu / ours.cpu:.0%} of convert")
    print(f"padding waste               {waste:8.2%}")


def _check_against_reference(
    name: str, batch: TrainBatch, ref_packs: list[Pack], ref_info: dict[str, float], n_check: int
) -> None:
    if len(ref_packs) != len(batch.packs) or not all(
        _same(a, b) for a, b in zip(batch.packs[:n_check], ref_packs[:n_check], strict=True)
    ):
        raise SystemExit(f"convert_groups on {name} and the reference disagree on the packs")
    for key, want in ref_info.items():
        if not math.isclose(batch.data_info[key], want, rel_tol=1e-6, abs_tol=1e-6):
            raise SystemExit(f"{name}: {key}: convert_groups {batch.data_info[key]} != {want}")


if __name__ == "__main__":
    main()
