"""The ranges of ``routed_experts`` (MoE experts per position and layer, [T, L, k]).

Shape legend: T = len(input_ids), L = MoE layers, k = experts per token.
Design: docs/routing-replay.md
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NOT_ROUTED = -1  # a routed_experts row of a position the model never took as input
ROUTING_INVARIANT = 9  # routed_experts' ranges (docs/routing-replay.md)


def routing_problems(e: np.ndarray | None, num_experts: int | None) -> list[tuple[int, str]]:
    """(first offending position, message) of what is wrong with routed_experts ``e``
    [T, L, k]: each position's row must be all NOT_ROUTED or expert ids in [0, num_experts)
    (when known), no expert twice within a layer's k."""
    if e is None or e.size == 0:
        return []
    out: list[tuple[int, str]] = []
    unrouted = (e == NOT_ROUTED).all(axis=(1, 2))  # [T]
    high = num_experts if num_experts is not None else np.iinfo(np.int64).max
    bad = ((e < 0) | (e >= high)).any(axis=(1, 2)) & ~unrouted  # [T]
    if bad.any():
        at = int(np.argmax(bad))
        need = f"[0, {num_experts})" if num_experts is not None else ">= 0"
        msg = f"expert ids {e[at].tolist()} not all {need} (nor a row of -1: not routed)"
        out.append((at, msg))
    ordered = np.sort(e, axis=2)  # [T, L, k]
    twice = ((ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=(1, 2))) & ~unrouted  # [T]
    if twice.any():
        at = int(np.argmax(twice))
        msg = f"an expert chosen twice in one layer: {e[at].tolist()}"
        out.append((at, msg))
    return out


def stitch_turns(total: int, turns: Sequence[np.ndarray]) -> np.ndarray:
    """The routing of a sequence built turn by turn, [T, L, k]: row t is the routing of the
    first turn that fed ``input_ids[t]`` to the model; rows no turn fed are NOT_ROUTED.

    ``turns`` are the engine's routings in generation order, each [C + n, L, k] for its
    context (C tokens, a prefix of the sequence) and its n generated tokens, the last row
    NOT_ROUTED (sampled, never fed). A later turn feeds the earlier tokens again in its
    prefill (the engine may route them differently); the first routing is kept, since the
    earlier tokens' logprobs were computed with it. The previous turn's last token and the
    environment tokens are first fed by the next turn's prefill, so they take its routing.
    Rows past ``total`` (a loop that cut the sequence) are dropped.
    """
    assert turns, "at least one turn"
    shape = turns[0].shape[1:]  # (L, k)
    out = np.full((total, *shape), NOT_ROUTED, dtype=np.int64)  # [T, L, k]
    for routing in turns:
        if routing.shape[1:] != shape:
            raise ValueError(
                f"turns routed with different shapes {shape} and {routing.shape[1:]} (layers, "
                "experts per token): one model must generate every turn of a sample"
            )
        end = min(total, len(routing))
        free = (out[:end] == NOT_ROUTED).all(axis=(1, 2))  # [end] not fed by an earlier turn
        out[:end][free] = routing[:end][free]
    return out
