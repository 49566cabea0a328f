"""Routing capture for the Hugging Face engine: which experts each token of a generate call went
to, per MoE layer, prompt positions included.

Shape legend: B = rows, U = distinct contexts of a shared prefill, P = padded context length,
C_b = real context length of row b, n_b = tokens it generated, L = MoE layers, k = experts
per token. Design: docs/routing-replay.md
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rltool.rollout.routing import NOT_ROUTED


def rows_routing(
    forwards: Sequence[torch.Tensor],
    contexts: Sequence[Sequence[int]],
    new_tokens: Sequence[int],
    shared_prefill: bool,
) -> list[np.ndarray]:
    """Per row, the experts of its context and generated tokens, [C_b + n_b, L, k].

    ``forwards`` are the recorded forwards of one generate call, in order ([U, P - 1, L, k]
    first when the prefill was shared, then [B, S, L, k] each): concatenated along the
    positions they cover the left-padded contexts, then one generated token per decode step.
    The last generated token is never fed back, so its row is NOT_ROUTED.
    """
    parts = list(forwards)
    if shared_prefill:
        distinct: dict[tuple[int, ...], int] = {}  # the same order as SharedPrefill.cache
        row_of = [distinct.setdefault(tuple(c), len(distinct)) for c in contexts]  # [B]
        parts[0] = parts[0][torch.tensor(row_of, device=parts[0].device)]  # [B, P - 1, L, k]
    fed = torch.cat(parts, dim=1).to("cpu", torch.long).numpy()  # [B, P + steps, L, k]
    width = max(len(c) for c in contexts)  # P
    out = []
    for b, (c, n) in enumerate(zip(contexts, new_tokens, strict=True)):
        seen = fed[b, width - len(c) : width + n - 1]  # [C_b + n_b - 1, L, k]
        last = np.full((1, *seen.shape[1:]), NOT_ROUTED, dtype=np.int64)
        out.append(np.concatenate([seen, last]))  # [C_b + n_b, L, k]
    return out
