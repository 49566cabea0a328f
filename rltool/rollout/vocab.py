"""Invariant 10: every token id is in ``[0, vocab_size)`` where the vocabulary is known.

The size is the model's embedding rows (``config.vocab_size``), not ``len(tokenizer)``:
an id the tokenizer cannot decode still trains where the embedding has its row, and an
id past the rows is the ``IndexError`` of the trainer's embedding lookup. A negative id
is outside every vocabulary, so it is flagged even where the size is unknown.

Shape legend: F = positions of many samples concatenated, S = samples, M = offending.
"""

from __future__ import annotations

import numpy as np

from rltool.rollout.fields import first_per_segment

VOCAB_INVARIANT = 10  # data-contract section 4
VOCAB_KIND = "token ids in the vocabulary"  # the failure reason's words (rollout/failures.py)


def vocab_problems(
    ids_F: np.ndarray, start_S: np.ndarray, vocab_size: int | None
) -> list[tuple[int, int, str]]:
    """(sample, first offending position, message) of each sample holding an id outside
    ``[0, vocab_size)`` (``vocab_size`` None: a negative id)."""
    bad_F = ids_F < 0  # [F]
    if vocab_size is not None:
        bad_F |= ids_F >= vocab_size
    rows, at = first_per_segment(np.flatnonzero(bad_F), start_S)  # [M], [M]
    values = ids_F[start_S[rows] + at].tolist()  # [M]
    return [
        (r, a, id_problem(v, vocab_size))
        for r, a, v in zip(rows.tolist(), at.tolist(), values, strict=True)
    ]


def id_problem(token_id: int, vocab_size: int | None) -> str:
    """Why ``token_id`` is not a token of the vocabulary (it is not)."""
    if vocab_size is not None:
        return f"token id {token_id} outside the vocabulary [0, {vocab_size})"
    if token_id < 0:
        return f"token id {token_id} is negative"
    return f"token id {token_id} does not fit a 64-bit integer"


def first_bad_id(ids: list[int], vocab_size: int | None) -> int | None:
    """The position of an id of ``ids`` outside ``[0, vocab_size)`` (the first one, or one
    beyond 64 bits), or None when every id is a token."""
    try:
        a = np.asarray(ids, dtype=np.int64)  # [R]
    except OverflowError:  # beyond 64 bits: outside any vocabulary
        return next(i for i, t in enumerate(ids) if not -(2**63) <= t < 2**63)
    bad = a < 0  # [R]
    if vocab_size is not None:
        bad |= a >= vocab_size
    return int(np.argmax(bad)) if bad.any() else None
