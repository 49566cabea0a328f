"""Best-fit-decreasing packing of shifted sample lengths into rows.

Shape legend: S = samples, B = rows (bins).
Design: docs/foundations.md#packing
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np


def pack_lengths(
    lengths: Sequence[int] | np.ndarray, max_len: int, ids: Sequence[str] | None = None
) -> list[list[int]]:
    """Rows of sample indices whose lengths sum to at most ``max_len``.

    Every index appears exactly once; indices inside a row are ascending.
    ``ids`` (e.g. rollout ids) name a sample in the error for one that is too long.
    """
    lengths_S = np.asarray(lengths, dtype=np.int64)  # [S]
    bad = np.flatnonzero((lengths_S > max_len) | (lengths_S < 1))
    if bad.size:
        i = int(bad[0])
        name = f"sample {ids[i]!r}" if ids is not None else f"sample {i}"
        if lengths_S[i] < 1:
            raise ValueError(f"{name}: shifted length {lengths_S[i]} < 1 (needs >= 2 tokens)")
        raise ValueError(
            f"{name}: shifted length {lengths_S[i]} > trainer.pack_max_length {max_len}; "
            "raise pack_max_length or lower the generation length (max_new_tokens)"
        )
    order = np.argsort(-lengths_S, kind="stable").tolist()  # longest first, ties by index
    lens = lengths_S.tolist()
    free: list[tuple[int, int]] = []  # (remaining capacity, row), sorted
    rows: list[list[int]] = []
    for i in order:
        n = lens[i]
        k = bisect_left(free, (n, -1))  # first row with remaining >= n
        if k == len(free):
            rows.append([i])
            row, remaining = len(rows) - 1, max_len - n
        else:
            remaining, row = free.pop(k)
            rows[row].append(i)
            remaining -= n
        if remaining > 0:
            insort(free, (remaining, row))
    return [sorted(r) for r in rows]


def padding_waste(total_tokens: int, num_rows: int, max_len: int) -> float:
    """1 - tokens / (rows * max_len): the share of fixed-width rows left empty."""
    if num_rows == 0:
        return 0.0
    return 1.0 - total_tokens / (num_rows * max_len)
