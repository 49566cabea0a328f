"""The rich terminal view of a TrainBatch: what ``inspect-batch`` shows.

Each packed sample is shown token by token in its shifted form: the model
input at a position, the target it is trained to predict there (the next
token's label), the per-position advantage, the rollout logprob and the
staleness of the target token. Colour tells the three kinds of target apart:

- supervised (green): the loss trains on it;
- masked (dim): prompt, tool/environment output, padding glue (label -100);
- stale (red, struck through): supervised when generated, cleared by the
  staleness bake. Told apart from masked by comparing the labels of the
  groups *before* conversion with the targets after it.

Short samples get a table; long ones flow as coloured tokens, several per
line, so that a 1k-token sample stays readable. This module only renders:
the batch comes from ``convert_groups``, never from a second conversion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from rltool.report.batch_json import slice_sample
from rltool.rollout.state import IGNORE_INDEX, RolloutState
from rltool.training.batch import Pack, SampleInfo, TrainBatch

Decoder = Callable[[list[int]], list[str]]  # token ids -> one display string per id

TABLE_MAX_TOKENS = 48  # longer samples flow as coloured text
FLOW_MARK_EVERY = 100  # a position marker every this many tokens in the flowing view

MASKED, SUPERVISED, STALE = 0, 1, 2
STYLES = {SUPERVISED: "green", MASKED: "dim", STALE: "red strike"}
ROW_STYLES = {SUPERVISED: None, MASKED: "dim", STALE: "red"}
KIND_NAMES = {SUPERVISED: "supervised", MASKED: "masked", STALE: "stale"}


@dataclass(slots=True)
class TokenRows:
    """One shifted sample, ready to render. L = SampleInfo.length."""

    input_ids: list[int]  # [L] model input
    target_ids: list[int]  # [L] the token predicted at each position (before any masking)
    kinds: list[int]  # [L] MASKED | SUPERVISED | STALE
    advantages: list[float]  # [L]
    logprobs: list[float]  # [L]
    staleness: list[float]  # [L] of the target token; nan where it is a prompt token or unknown


def tokenizer_decoder(tokenizer: Any) -> Decoder:
    """A Decoder from a Hugging Face tokenizer: each id decoded on its own."""

    def decode(ids: list[int]) -> list[str]:
        return tokenizer.batch_decode([[i] for i in ids])

    return decode


def _ids_as_text(ids: list[int]) -> list[str]:
    return [str(i) for i in ids]


def target_staleness(state: RolloutState, train_step: int) -> torch.Tensor:
    """Staleness ``train_step - model_step - 1`` of each shifted target.  # [T - 1]

    Target at shifted position i is the token at i + 1; prompt tokens and
    samples without ``response_model_steps`` get nan (shown blank).
    """
    assert state.input_ids is not None
    staleness = torch.full((len(state.input_ids),), math.nan, dtype=torch.float64)  # [T]
    if state.response_model_steps is not None:
        steps = torch.tensor(state.response_model_steps, dtype=torch.float64)  # [R]
        staleness[len(state.prompt_ids) :] = train_step - steps - 1
    return staleness[1:]  # [T - 1]


def target_kinds(targets: torch.Tensor, labels_before: list[int]) -> torch.Tensor:
    """MASKED / SUPERVISED / STALE per shifted position.  # [L]

    Stale = supervised in the labels before conversion, -100 after it.
    """
    before = torch.tensor(labels_before[1:], dtype=torch.long)  # [L]
    supervised = targets != IGNORE_INDEX  # [L]
    stale = (before != IGNORE_INDEX) & ~supervised  # [L]
    return supervised.long() * SUPERVISED + stale.long() * STALE  # [L]


def token_rows(
    batch: TrainBatch, info: SampleInfo, before: RolloutState, train_step: int
) -> TokenRows:
    assert before.input_ids is not None and before.labels is not None
    s = slice_sample(batch, info)
    if len(before.input_ids) != info.length + 1:
        raise ValueError(
            f"sample {info.rollout_id}: {len(before.input_ids)} input_ids before conversion but "
            f"shifted length {info.length} in the batch; the groups do not match the batch"
        )
    return TokenRows(
        input_ids=s.input_ids.tolist(),
        target_ids=before.input_ids[1:].tolist(),
        kinds=target_kinds(s.targets, before.labels).tolist(),
        advantages=s.advantages.tolist(),
        logprobs=s.rollout_logprobs.tolist(),
        staleness=target_staleness(before, train_step).tolist(),
    )


def _printable(token: str) -> str:
    return token.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def legend() -> Text:
    text = Text("legend: ", style="bold")
    for kind in (SUPERVISED, MASKED, STALE):
        text.append(KIND_NAMES[kind], style=STYLES[kind])
        text.append("  ")
    text.append("(colour of each target; stale = label cleared by token staleness)", style="dim")
    return text


def pack_rule_title(index: int, pack: Pack) -> str:
    used = int(pack.cu_seq_lens[-1])
    padding = f", padding {len(pack) - used}" if len(pack) > used else ""
    return (
        f"pack {index}: cu_seq_lens={pack.cu_seq_lens.tolist()}, length {len(pack)}, "
        f"max_seq_len {pack.max_seq_len}{padding}"
    )


def sample_header(info: SampleInfo, before: RolloutState, rows: TokenRows) -> Text:
    counts = {k: rows.kinds.count(k) for k in (SUPERVISED, MASKED, STALE)}
    score = before.score
    reward = "none" if score is None else f"{score:g}"
    text = Text()
    text.append(info.rollout_id, style="bold cyan")
    text.append(
        f"  group {info.group_id}  pack {info.pack}  start {info.start}  length {info.length}"
        f"  advantage {info.advantage:+.6g}  reward {reward}"
    )
    text.append(
        f"\n  task {info.task_name}  prompt {len(before.prompt_ids)}  "
        f"supervised {counts[SUPERVISED]}  masked {counts[MASKED]}  stale {counts[STALE]}",
        style="dim",
    )
    if not info.has_rollout_logprobs:
        text.append("  (no rollout logprobs)", style="dim")
    return text


def _fmt(value: float, spec: str) -> str:
    return "" if math.isnan(value) else format(value, spec)


def token_table(rows: TokenRows, decode: Decoder) -> Table:
    inputs, targets = decode(rows.input_ids), decode(rows.target_ids)
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for name in ("pos", "input", "target", "adv", "logprob", "stale"):
        table.add_column(name, justify="right" if name != "input" and name != "target" else "left")
    for i, kind in enumerate(rows.kinds):
        # the cleared label is shown struck through; the mark keeps it visible without colour
        target = {MASKED: "-100", STALE: f"✗{_printable(targets[i])}"}.get(
            kind, _printable(targets[i])
        )
        table.add_row(
            str(i),
            Text(_printable(inputs[i])),
            Text(target, style=STYLES[kind]),
            _fmt(rows.advantages[i], "+.4f"),
            _fmt(rows.logprobs[i], ".4f"),
            _fmt(rows.staleness[i], ".0f"),
            style=ROW_STYLES[kind],
        )
    return table


def token_flow(rows: TokenRows, first_token: int, decode: Decoder, separator: str) -> Text:
    """The whole sequence as coloured tokens: each token coloured by its kind as a target.

    Without a separator (decoded text) every other token gets a faint background,
    so token boundaries stay visible inside words.
    """
    pieces = decode([first_token, *rows.target_ids])
    shade = "" if separator else " on grey15"
    text = Text(_printable(pieces[0]), style=STYLES[MASKED])
    for i, kind in enumerate(rows.kinds):
        pos = i + 1
        if pos % FLOW_MARK_EVERY == 0:
            text.append(f"{separator}⟨{pos}⟩", style="blue")
        text.append(separator)
        text.append(_printable(pieces[pos]), style=STYLES[kind] + (shade if pos % 2 else ""))
    return text


def render_sample(
    console: Console,
    info: SampleInfo,
    before: RolloutState,
    rows: TokenRows,
    decode: Decoder | None,
) -> None:
    console.print(sample_header(info, before, rows))
    if info.length <= TABLE_MAX_TOKENS:
        console.print(token_table(rows, decode or _ids_as_text))
    else:
        assert before.input_ids is not None
        # ids need a visible separator; decoded text reads best joined as it was generated
        flow = token_flow(
            rows, before.input_ids[0], decode or _ids_as_text, " " if decode is None else ""
        )
        console.print(flow)
    console.print()


def data_info_table(data_info: dict[str, float]) -> Table:
    table = Table(title="data_info", title_justify="left", header_style="bold")
    table.add_column("key")
    table.add_column("value", justify="right")
    for key, value in data_info.items():
        table.add_row(key, f"{value:.6g}")
    return table


def skipped_table(batch: TrainBatch) -> Table | Text:
    if not batch.skipped_groups:
        return Text("skipped groups: none", style="dim")
    table = Table(title="skipped groups", title_justify="left", header_style="bold")
    for name in ("group_id", "reason", "detail"):
        table.add_column(name, overflow="fold")
    for g in batch.skipped_groups:
        table.add_row(g.group_id, Text(g.reason, style="yellow"), Text(g.detail))
    return table


def _by_rollout_id(groups: Iterable[Sequence[RolloutState]]) -> dict[str, RolloutState]:
    return {s.rollout_id: s for group in groups for s in group}


def render_batch(
    console: Console,
    batch: TrainBatch,
    groups_before: Iterable[Sequence[RolloutState]],
    *,
    train_step: int,
    sample_indices: Sequence[int] | None = None,
    decode: Decoder | None = None,
) -> None:
    """Print the batch: legend, each pack's selected samples, data_info, skipped groups.

    ``groups_before`` are the groups as they were before ``convert_groups``
    (a deep copy: the bake edits labels in place); ``sample_indices`` index
    ``batch.samples`` and select which samples are shown.
    """
    before = _by_rollout_id(groups_before)
    selected = set(range(len(batch.samples)) if sample_indices is None else sample_indices)
    console.print(legend())
    for k, pack in enumerate(batch.packs):
        shown = [i for i in pack.sample_index if i in selected]
        if not shown:
            continue
        console.rule(pack_rule_title(k, pack), style="blue")
        for i in shown:
            info = batch.samples[i]
            state = before[info.rollout_id]
            render_sample(console, info, state, token_rows(batch, info, state, train_step), decode)
    console.print(Group(data_info_table(batch.data_info), skipped_table(batch)))
