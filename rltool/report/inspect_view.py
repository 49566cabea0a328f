"""The rich terminal view of a TrainBatch: what ``inspect-batch`` shows.

Each packed sample is shown token by token in its shifted form: the model
input at a position, the target it is trained to predict there (the next
token's label), the per-position advantage, the rollout logprob and the
staleness of the target token. Colour tells the three kinds of target apart:

- supervised (green): the loss trains on it;
- masked (dim): prompt, tool/environment output, padding glue (label -100);
- stale (red, struck through): supervised when generated, marked as not trained
  by the staleness bake. Told apart from masked by the positions the bake
  reports it cleared (``rltool.rollout.staleness.bake_group``).

In a shared-prefix pack each tree's prefix is shown once, then every sample's
branch (positions numbered in the sample, so a branch starts at the prefix
length). Short pieces get a table; long ones flow as coloured tokens, several
per line, so that a 1k-token sample stays readable. This module only renders:
the batch comes from ``convert_groups``, never from a second conversion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import numpy as np
import torch
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from rltool.report.batch_json import layout_of, slice_sample
from rltool.rollout.staleness import position_staleness
from rltool.rollout.state import IGNORE_INDEX, RolloutState
from rltool.training.attention import KERNEL_NOTES
from rltool.training.batch import Pack, SampleInfo, SharedPack, TrainBatch

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

    def window(self, lo: int, hi: int) -> TokenRows:
        """Positions [lo, hi) only."""
        return TokenRows(
            self.input_ids[lo:hi], self.target_ids[lo:hi], self.kinds[lo:hi],
            self.advantages[lo:hi], self.logprobs[lo:hi], self.staleness[lo:hi],
        )  # fmt: skip


def tokenizer_decoder(tokenizer: Any) -> Decoder:
    """A Decoder from a Hugging Face tokenizer: each id decoded on its own."""

    def decode(ids: list[int]) -> list[str]:
        return tokenizer.batch_decode([[i] for i in ids])

    return decode


def _ids_as_text(ids: list[int]) -> list[str]:
    return [str(i) for i in ids]


def target_staleness(state: RolloutState, train_step: int) -> np.ndarray:
    """Staleness of each shifted target (``position_staleness``, the rule the bake reads).
    # [T - 1]

    Target at shifted position i is the token at i + 1; prompt tokens and
    samples without ``response_model_steps`` get nan (shown blank).
    """
    return position_staleness(state, train_step)[1:]  # [T - 1]


def target_kinds(targets: torch.Tensor, stale_T: np.ndarray | None) -> torch.Tensor:
    """MASKED / SUPERVISED / STALE per shifted position.  # [L]

    ``stale_T`` [T]: the positions the bake cleared (None: none); target i is token i + 1.
    """
    supervised = targets != IGNORE_INDEX  # [L]
    kinds = supervised.long() * SUPERVISED  # [L]
    if stale_T is not None:
        stale = torch.from_numpy(stale_T[1:]) & ~supervised  # [L]
        kinds += stale.long() * STALE
    return kinds


def token_rows(
    batch: TrainBatch,
    info: SampleInfo,
    state: RolloutState,
    train_step: int,
    stale_T: np.ndarray | None = None,
) -> TokenRows:
    """One sample's rows: the batch's fields, ``state`` (the converted sample) for the
    unmasked targets and staleness, ``stale_T`` [T] the positions the bake cleared."""
    assert state.input_ids is not None
    s = slice_sample(batch, info)
    if len(state.input_ids) != info.length + 1:
        raise ValueError(
            f"sample {info.rollout_id}: {len(state.input_ids)} input_ids in the groups but "
            f"shifted length {info.length} in the batch; the groups do not match the batch"
        )
    return TokenRows(
        input_ids=s.input_ids.tolist(),
        target_ids=state.input_ids[1:].tolist(),
        kinds=target_kinds(s.targets, stale_T).tolist(),
        advantages=s.advantages.tolist(),
        logprobs=s.rollout_logprobs.tolist(),
        staleness=target_staleness(state, train_step).tolist(),
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


def layout_line(batch: TrainBatch) -> Text:
    """The rows' layout and attention kernel, as conversion chose them."""
    layout, attention = layout_of(batch)
    text = Text("rows: ", style="bold")
    text.append(f"{layout} layout, attention {attention}")
    notes = "; ".join(KERNEL_NOTES[k] for k in attention.split(",") if k in KERNEL_NOTES)
    return text.append(f" ({notes})" if notes else "", style="dim")


def pack_rule_title(index: int, pack: Pack) -> str:
    used = int(pack.cu_seq_lens[-1])
    padding = f", padding {len(pack) - used}" if len(pack) > used else ""
    trees = ""  # first: a long title is cut at the console's width
    if isinstance(pack, SharedPack):
        trees = f" ({_count(int(pack.tree_ids.max()) + 1, 'shared-prefix tree')})"
    return (
        f"pack {index}{trees}: cu_seq_lens={pack.cu_seq_lens.tolist()}, length {len(pack)}, "
        f"max_seq_len {pack.max_seq_len}{padding}"
    )


def sample_header(info: SampleInfo, state: RolloutState, rows: TokenRows) -> Text:
    counts = {k: rows.kinds.count(k) for k in (SUPERVISED, MASKED, STALE)}
    score = state.score
    reward = "none" if score is None else f"{score:g}"
    text = Text()
    text.append(info.rollout_id, style="bold cyan")
    text.append(
        f"  group {info.group_id}  pack {info.pack}  start {info.start}  length {info.length}"
        f"  advantage {info.advantage:+.6g}  reward {reward}"
    )
    if info.prefix_length:
        text.append(
            f"\n  ⎇ branch at {info.branch_start}, after the shared prefix of "
            f"{info.prefix_length} at {info.start}",
            style="magenta",
        )
    text.append(
        f"\n  task {info.task_name}  prompt {len(state.prompt_ids)}  "
        f"supervised {counts[SUPERVISED]}  masked {counts[MASKED]}  stale {counts[STALE]}",
        style="dim",
    )
    if not info.has_rollout_logprobs:
        text.append("  (no rollout logprobs)", style="dim")
    return text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _fmt(value: float, spec: str) -> str:
    return "" if math.isnan(value) else format(value, spec)


def token_table(rows: TokenRows, decode: Decoder, first_pos: int = 0) -> Table:
    """One row per position; ``first_pos`` numbers the first one (a branch starts after its
    prefix)."""
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
            str(first_pos + i),
            Text(_printable(inputs[i])),
            Text(target, style=STYLES[kind]),
            _fmt(rows.advantages[i], "+.4f"),
            _fmt(rows.logprobs[i], ".4f"),
            _fmt(rows.staleness[i], ".0f"),
            style=ROW_STYLES[kind],
        )
    return table


def token_flow(rows: TokenRows, decode: Decoder, separator: str, first_pos: int = 0) -> Text:
    """The sequence as coloured tokens: the first input (never a target here: masked), then
    each target coloured by its kind. ``first_pos``: the position of the first input.

    Without a separator (decoded text) every other token gets a faint background,
    so token boundaries stay visible inside words.
    """
    pieces = decode([rows.input_ids[0], *rows.target_ids])
    shade = "" if separator else " on grey15"
    text = Text(_printable(pieces[0]), style=STYLES[MASKED])
    for i, kind in enumerate(rows.kinds):
        pos = first_pos + i + 1  # position of the target token in the sequence
        if pos % FLOW_MARK_EVERY == 0:
            text.append(f"{separator}⟨{pos}⟩", style="blue")
        text.append(separator)
        text.append(_printable(pieces[i + 1]), style=STYLES[kind] + (shade if pos % 2 else ""))
    return text


def render_tokens(
    console: Console, rows: TokenRows, decode: Decoder | None, first_pos: int = 0
) -> None:
    """A table for a short piece, coloured flowing tokens for a long one."""
    if len(rows.kinds) <= TABLE_MAX_TOKENS:
        console.print(token_table(rows, decode or _ids_as_text, first_pos))
    else:
        # ids need a visible separator; decoded text reads best joined as it was generated
        separator = " " if decode is None else ""
        console.print(token_flow(rows, decode or _ids_as_text, separator, first_pos))
    console.print()


def prefix_header(start: int, length: int, rollout_ids: Sequence[str]) -> Text:
    text = Text("shared prefix", style="bold magenta")
    for_ids = ", ".join(rollout_ids)
    text.append(f"  at {start}, {_count(length, 'position')}, shown once for {for_ids}")
    return text


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


@dataclass(slots=True)
class _View:
    """What rendering a sample needs besides the batch."""

    batch: TrainBatch
    states: dict[str, RolloutState]  # by rollout_id, the samples as converted
    stale: Mapping[str, np.ndarray]  # rollout_id -> [T] positions the bake cleared
    train_step: int
    decode: Decoder | None

    def rows(self, info: SampleInfo) -> TokenRows:
        state = self.states[info.rollout_id]
        return token_rows(self.batch, info, state, self.train_step, self.stale.get(info.rollout_id))


def _render_tree(console: Console, view: _View, pack: Pack, infos: list[SampleInfo]) -> None:
    """Samples that read one prefix (``infos``, the shown ones, in row order): the prefix
    once, then each branch. A sample without a prefix is its own whole piece."""
    first, q = infos[0], infos[0].prefix_length
    rows = {x.rollout_id: view.rows(x) for x in infos}
    if q:
        members = [view.batch.samples[i] for i in pack.sample_index]
        tree = [x.rollout_id for x in members if (x.start, x.prefix_length) == (first.start, q)]
        console.print(prefix_header(first.start, q, tree))
        render_tokens(console, rows[first.rollout_id].window(0, q), view.decode)
    for info in infos:
        state = view.states[info.rollout_id]
        console.print(sample_header(info, state, rows[info.rollout_id]))
        render_tokens(console, rows[info.rollout_id].window(q, info.length), view.decode, q)


def render_batch(
    console: Console,
    batch: TrainBatch,
    groups: Iterable[Sequence[RolloutState]],
    *,
    train_step: int,
    stale: Mapping[str, np.ndarray] | None = None,
    sample_indices: Sequence[int] | None = None,
    decode: Decoder | None = None,
) -> None:
    """Print the batch: legend, each pack's selected samples, data_info, skipped groups.

    ``groups`` are the groups that were converted; ``stale`` maps a rollout_id to the
    positions [T] the staleness bake cleared (as ``bake_group`` reported them);
    ``sample_indices`` index ``batch.samples`` and select which samples are shown.
    """
    view = _View(batch, _by_rollout_id(groups), stale or {}, train_step, decode)
    selected = set(range(len(batch.samples)) if sample_indices is None else sample_indices)
    console.print(legend())
    console.print(layout_line(batch))
    for k, pack in enumerate(batch.packs):
        shown = [batch.samples[i] for i in pack.sample_index if i in selected]
        if not shown:
            continue
        console.rule(pack_rule_title(k, pack), style="blue")
        for _, tree in groupby(shown, key=lambda x: (x.start, x.prefix_length)):
            _render_tree(console, view, pack, list(tree))
    console.print(Group(data_info_table(batch.data_info), skipped_table(batch)))
