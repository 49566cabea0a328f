"""The ranges of ``routed_experts`` (MoE experts per position and layer, [T, L, k]).

Shape legend: T = len(input_ids), L = MoE layers, k = experts per token.
Design: docs/routing-replay.md
"""

from __future__ import annotations

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
