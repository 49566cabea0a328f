"""Why samples failed, in short grouped reasons ("sandbox: bwrap not found", "reward: timeout")
that step lines, metrics, evaluations and summaries count."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from rltool.rollout.state import RolloutState, Status

MAX_REASON_CHARS = 60
_PREFIX = re.compile(r"[A-Za-z_][\w.]{0,23}")  # a short word or dotted name before ": "
_DETAIL_END = re.compile(r"[:(\n]")


def failure_reason(error: str | None) -> str:
    """The short reason of a sample's ``error``: its ``prefix: first detail`` when it has a
    short prefix, else its first line; at most 60 characters."""
    if not error or not error.strip():
        return "unknown"
    text = error.strip()
    prefix, sep, rest = text.partition(": ")
    if sep and _PREFIX.fullmatch(prefix):
        detail = _DETAIL_END.split(rest, maxsplit=1)[0].strip()
        reason = f"{prefix}: {detail}" if detail else prefix
    else:
        reason = text.splitlines()[0].strip()
    return reason[:MAX_REASON_CHARS]


def count_reasons(samples: Iterable[RolloutState]) -> dict[str, int]:
    """Failed samples by reason, most frequent first (ties by reason)."""
    counts = Counter(failure_reason(s.error) for s in samples if s.status == Status.FAILED)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
