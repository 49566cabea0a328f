"""``inspect-batch --routing ROLLOUT_ID:POSITION``: the experts one token went to, per MoE
layer, as the rollout recorded them and as the packed row replays them.

Position is the token's index in the sample's ``input_ids``. The shift gives position
i < T - 1 to the model input at the sample's packed position i (``routed_experts[:-1]``);
the last token is never a model input.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rltool.report.inspect_view import Decoder
from rltool.rollout.routing import NOT_ROUTED
from rltool.rollout.state import RolloutState
from rltool.training.batch import SampleInfo, TrainBatch


def parse_routing_request(text: str) -> tuple[str, int]:
    """``ROLLOUT_ID:POSITION`` -> (rollout_id, position); ValueError naming the flag."""
    rid, sep, pos = text.rpartition(":")
    if not sep or not rid or not pos.isdigit():
        raise ValueError(f"--routing {text!r}: give ROLLOUT_ID:POSITION, e.g. r3:12")
    return rid, int(pos)


def packed_position(info: SampleInfo, position: int) -> int:
    """Where input position ``position`` (< T - 1) of a sample sits in its pack."""
    if position < info.prefix_length:
        return info.start + position
    return info.branch_start + position - info.prefix_length


def routing_of_token(
    batch: TrainBatch, groups: Sequence[Sequence[RolloutState]], rollout_id: str, position: int
) -> dict[str, object]:
    """The token's recorded experts [L][k] and the packed row's ([L][k], or None for the last
    token); ValueError naming what is missing."""
    state = next((s for g in groups for s in g if s.rollout_id == rollout_id), None)
    if state is None:
        raise ValueError(f"--routing: no sample {rollout_id!r} in the input")
    if state.routed_experts is None:
        raise ValueError(f"--routing: sample {rollout_id} carries no routed_experts")
    t = len(state.input_ids)
    if position >= t:
        raise ValueError(f"--routing: position {position} is past sample {rollout_id}'s {t} tokens")
    out: dict[str, object] = {
        "rollout_id": rollout_id,
        "position": position,
        "token": int(state.input_ids[position]),
        "recorded": state.routed_experts[position].tolist(),  # [L][k]
        "pack": None,
        "packed_position": None,
        "replayed": None,
    }
    info = next((x for x in batch.samples if x.rollout_id == rollout_id), None)
    if info is not None and position < t - 1:
        pack = batch.packs[info.pack]
        at = packed_position(info, position)
        out |= {"pack": info.pack, "packed_position": at}
        if pack.routed_experts is not None:
            out["replayed"] = pack.routed_experts[at].tolist()
    return out


def render_routing(
    console: Console, found: dict[str, object], decode: Decoder | None = None
) -> None:
    """One row per MoE layer: the experts recorded at generation and those the packed row
    replays (the same, unless the row is missing)."""
    token = found["token"]
    shown = decode([token])[0] if decode is not None else str(token)
    title = f"routing of {found['rollout_id']} position {found['position']} (token {shown!r})"
    if found["pack"] is not None:
        title += f": pack {found['pack']} position {found['packed_position']}"
    else:
        title += ": not a model input (the last token, or the sample was skipped)"
    table = Table(title=title, title_justify="left")
    table.add_column("layer", justify="right")
    table.add_column("recorded experts")
    table.add_column("replayed in training")
    replayed = found["replayed"]
    for layer, experts in enumerate(found["recorded"]):
        rec = "not routed" if all(e == NOT_ROUTED for e in experts) else str(experts)
        rep = "-" if replayed is None else str(replayed[layer])
        table.add_row(str(layer), rec, rep)
    console.print(table if found["recorded"] else Text("no MoE layers recorded"))
