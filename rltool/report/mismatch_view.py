"""``inspect-batch --model``: per token, the rollout's logprob beside the trainer's, their
difference, the correction's weight and mask, and (MoE) how many layers route differently.

The data (``SampleMismatch``) is gathered from a converted TrainBatch and the model's
recompute (``training.recompute``), over each sample's supervised targets only (the tokens
the loss sees). Δ = trainer logprob - rollout logprob = log(old / rollout), the log of the
importance ratio a correction works on. Rendered as a rich table per sample (rows coloured
by |Δ|) or as JSON (``mismatch_json``; keys in docs/inspect.md#where-the-mismatch-lives).

Shape legend: M = supervised targets of one sample, N = positions of a packed row,
L = MoE layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from rltool.report.batch_json import FLOAT_DECIMALS, sample_positions
from rltool.report.inspect_view import Decoder
from rltool.rollout.state import IGNORE_INDEX
from rltool.training.batch import TrainBatch
from rltool.training.recompute import PackRecompute

DELTA_BANDS = (0.01, 0.1)  # |Δ| below the first: green; below the second: yellow; else red
WORST_POSITIONS = 10  # the largest |Δ| listed after the samples


@dataclass(slots=True)
class SampleMismatch:
    """One sample's supervised targets, what each logprob says of them."""

    rollout_id: str
    positions: np.ndarray  # [M] shifted positions j (target j = labels[j + 1])
    token_ids: np.ndarray  # [M] the target tokens
    rollout_logprobs: np.ndarray | None  # [M] the engine's; None when it returned none
    trainer_logprobs: np.ndarray  # [M] the model's (old_logp)
    routing_layers: np.ndarray | None = None  # [M] MoE layers routing input j differently
    weights: np.ndarray | None = None  # [M] the correction's weight
    masked: np.ndarray | None = None  # [M] bool, a rejection criterion dropped the token

    @property
    def delta(self) -> np.ndarray | None:
        """[M] trainer - rollout logprob; None without rollout logprobs."""
        if self.rollout_logprobs is None:
            return None
        return self.trainer_logprobs - self.rollout_logprobs


def gather_mismatch(
    batch: TrainBatch, recomputed: Mapping[int, PackRecompute], indices: Sequence[int]
) -> list[SampleMismatch]:
    """The samples ``indices`` of ``batch``, gathered from their packs and the recompute of
    those packs (by pack number)."""
    out = []
    for i in indices:
        info = batch.samples[i]
        pack, rec = batch.packs[info.pack], recomputed[info.pack]
        at = sample_positions(info).numpy()  # [L_i] pack positions of the sample
        targets = pack.targets.numpy()[at]  # [L_i]
        keep = targets != IGNORE_INDEX  # [L_i]
        where = at[keep]  # [M] pack positions of its supervised targets
        rollout = (
            pack.rollout_logprobs.double().numpy()[where] if info.has_rollout_logprobs else None
        )
        layers = None if rec.routing_differs is None else rec.routing_differs[where].sum(-1)
        out.append(
            SampleMismatch(
                rollout_id=info.rollout_id,
                positions=np.flatnonzero(keep),
                token_ids=targets[keep],
                rollout_logprobs=rollout,
                trainer_logprobs=rec.logprobs[where],
                routing_layers=layers,
                weights=None if rec.weights is None else rec.weights[where],
                masked=None if rec.masked is None else rec.masked[where],
            )
        )
    return out


def _r(x: np.ndarray | None) -> list | None:
    return None if x is None else np.round(x.astype(np.float64), FLOAT_DECIMALS).tolist()


def _worst(samples: Sequence[SampleMismatch], n: int) -> list[dict[str, Any]]:
    rows = [
        (abs(float(d)), s, k)
        for s in samples
        if (delta := s.delta) is not None
        for k, d in enumerate(delta)
    ]
    rows.sort(key=lambda r: -r[0])
    out = []
    for _, s, k in rows[:n]:
        record = {
            "rollout_id": s.rollout_id,
            "position": int(s.positions[k]),
            "token_id": int(s.token_ids[k]),
            "rollout_logprob": round(float(s.rollout_logprobs[k]), FLOAT_DECIMALS),
            "trainer_logprob": round(float(s.trainer_logprobs[k]), FLOAT_DECIMALS),
            "delta": round(float(s.delta[k]), FLOAT_DECIMALS),
        }
        if s.routing_layers is not None:
            record["routing_layers_differ"] = int(s.routing_layers[k])
        out.append(record)
    return out


def _summary(s: SampleMismatch) -> dict[str, float | None]:
    delta = s.delta
    absd = None if delta is None or not delta.size else np.abs(delta)
    return {
        "tokens": int(s.positions.size),
        "mean_abs_delta": None if absd is None else round(float(absd.mean()), FLOAT_DECIMALS),
        "max_abs_delta": None if absd is None else round(float(absd.max()), FLOAT_DECIMALS),
        "routing_differs_frac": (
            None
            if s.routing_layers is None or not s.routing_layers.size
            else round(float((s.routing_layers > 0).mean()), FLOAT_DECIMALS)
        ),
    }


def mismatch_json(samples: Sequence[SampleMismatch], model: dict[str, Any]) -> dict[str, Any]:
    """The ``--format json`` object: the model used, per sample its arrays (one entry per
    supervised target) and summary, and the worst positions over all of them."""
    return {
        "model": model,
        "samples": [
            {
                "rollout_id": s.rollout_id,
                "positions": s.positions.tolist(),
                "token_ids": s.token_ids.tolist(),
                "rollout_logprobs": _r(s.rollout_logprobs),
                "trainer_logprobs": _r(s.trainer_logprobs),
                "delta": _r(s.delta),
                "weights": _r(s.weights),
                "masked": None if s.masked is None else s.masked.tolist(),
                "routing_layers_differ": (
                    None if s.routing_layers is None else s.routing_layers.tolist()
                ),
                "summary": _summary(s),
            }
            for s in samples
        ],
        "worst": _worst(samples, WORST_POSITIONS),
    }


def delta_style(delta: float | None) -> str:
    if delta is None:
        return "dim"
    d = abs(delta)
    return "green" if d < DELTA_BANDS[0] else "yellow" if d < DELTA_BANDS[1] else "bold red"


def _num(x: float | None, fmt: str = "{:+.4f}") -> str:
    return "—" if x is None else fmt.format(x)


def render_mismatch(
    console: Console,
    samples: Sequence[SampleMismatch],
    model: dict[str, Any],
    decode: Decoder | None = None,
) -> None:
    """One table per sample: position, token, rollout and trainer logprob, Δ, weight, mask
    and (MoE) the layers routing differently; rows coloured by |Δ|."""
    where = f" (step {model['step']})" if model.get("step") is not None else ""
    console.print(
        Text.assemble(("model ", "muted"), (str(model["path"]), "path"), where,
                      ("  temperature ", "muted"), str(model["temperature"]),
                      ("  routing replay ", "muted"), "on" if model["routing_replay"] else "off")
    )  # fmt: skip
    for s in samples:
        _render_sample(console, s, decode, model.get("moe_layers"))
    worst = _worst(samples, WORST_POSITIONS)
    if worst:
        table = Table(title="largest |Δ|", title_justify="left")
        for col in ("sample", "pos", "token", "Δ"):
            table.add_column(col, justify="right" if col != "sample" else "left")
        for w in worst:
            token = decode([w["token_id"]])[0] if decode else str(w["token_id"])
            table.add_row(
                w["rollout_id"],
                str(w["position"]),
                repr(token),
                Text(f"{w['delta']:+.4f}", style=delta_style(w["delta"])),
            )
        console.print(table)


def _render_sample(
    console: Console, s: SampleMismatch, decode: Decoder | None, num_layers: int | None
) -> None:
    summary = _summary(s)
    title = f"{s.rollout_id}: {summary['tokens']} supervised tokens"
    if summary["mean_abs_delta"] is not None:
        title += f", mean |Δ| {summary['mean_abs_delta']:.4f}, max {summary['max_abs_delta']:.4f}"
    if summary["routing_differs_frac"] is not None:
        title += f", routing differs at {summary['routing_differs_frac']:.0%}"
    console.print(Text(title, style="metric"))
    table = Table()
    columns = ["pos", "token", "rollout", "trainer", "Δ"]
    columns += ["weight"] if s.weights is not None else []
    columns += ["masked"] if s.masked is not None else []
    columns += ["routing"] if s.routing_layers is not None else []
    for col in columns:
        table.add_column(col, justify="left" if col == "token" else "right")
    tokens = decode(s.token_ids.tolist()) if decode else [str(t) for t in s.token_ids]
    delta = s.delta
    for k, pos in enumerate(s.positions):
        d = None if delta is None else float(delta[k])
        row = [
            str(int(pos)),
            repr(tokens[k]),
            _num(None if s.rollout_logprobs is None else float(s.rollout_logprobs[k])),
            _num(float(s.trainer_logprobs[k])),
            _num(d),
        ]
        if s.weights is not None:
            row.append(f"{float(s.weights[k]):.4g}")
        if s.masked is not None:
            row.append("masked" if s.masked[k] else "")
        if s.routing_layers is not None:
            n = int(s.routing_layers[k])
            row.append(f"{n}/{num_layers}" if num_layers else str(n))
        table.add_row(*row, style=delta_style(d))
    console.print(table)
