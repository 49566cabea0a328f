"""The reward of a reasoning-gym row: the generator's own ``score_answer`` on the answer
extracted as the row's ``answer_format`` says.

``score_answer`` expects an extracted answer and gives partial credit when the reference
is a substring of it (``"17"`` for 7 scores 0.5), so extraction comes first. A scorer
that raises or returns a score outside [0, 1] is a ``status="error"`` result, never 0.0.
Design: docs/environments.md#reasoning-gym
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

from rltool.rewards.gsm8k import RewardResult

# reasoning-gym's own tag pattern (reasoning_gym.utils.extract_answer): the last one counts
_ANSWER_TAG_RE = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def extract(text: str, answer_format: str) -> str | None:
    """The answer in ``text``: ``answer_tag``, the last ``<answer>...</answer>``;
    ``gsm8k``, the rest of the line after the last ``####``; None when absent or empty."""
    if answer_format == "answer_tag":
        found = _ANSWER_TAG_RE.findall(text)
        answer = found[-1].strip() if found else ""
    elif answer_format == "gsm8k":
        _, sep, tail = text.rpartition("####")
        answer = tail.strip().split("\n", 1)[0].strip() if sep else ""
    else:
        raise ValueError(f"unknown reasoning-gym answer_format {answer_format!r}")
    return answer or None


@functools.cache
def _scorer(dataset: str, config_json: str) -> Any:
    """One generator instance per (dataset, config): ``score_answer`` may read its config."""
    import reasoning_gym  # lazy: an optional extra; rows exist only where it is installed

    return reasoning_gym.create_dataset(dataset, seed=0, size=1, **json.loads(config_json))


def reasoning_gym_reward(response_text: str, row: dict[str, Any]) -> RewardResult:
    """Score one response against a row's ``reasoning_gym`` fields (``dataset``, ``config``,
    ``answer_format``, ``entry``); never raises: a failing scorer is an error result."""
    answer = extract(response_text, row["answer_format"])
    name = row["dataset"]
    try:
        config_json = json.dumps(row["config"], sort_keys=True)
        score = float(_scorer(name, config_json).score_answer(answer, row["entry"]))
    except Exception as exc:  # recorded on the sample and counted, never scored 0.0
        msg = f"{type(exc).__name__}: reasoning-gym {name} score_answer failed: {exc}"
        return RewardResult(None, "error", msg, extracted=answer)
    if not (math.isfinite(score) and 0.0 <= score <= 1.0):
        msg = f"ValueError: reasoning-gym {name} score_answer returned {score!r}, not in [0, 1]"
        return RewardResult(None, "error", msg, extracted=answer)
    return RewardResult(score, "ok", extracted=answer)
