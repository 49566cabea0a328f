"""Fields of other frameworks' rollout lines that the data contract does not define.

xtuner writes ``response_mask`` and ``agent_loop_type``, verl ``uid``, other exporters
their own. A line carrying such a field is still a sample: the field is kept aside in
``extra`` under its own name and the reader warns once per field name (the file's
other lines usually carry it too). One of them restates what the contract already
says: ``response_mask`` (one entry per response token, 1 where the model produced the
token) must agree with ``labels``, rltool's only supervision carrier; where it does
not, the file contradicts itself and ``validate-rollouts`` names it (invariant 3).
"""

from __future__ import annotations

import difflib
from typing import Any

import numpy as np

from rltool.rollout.state import IGNORE_INDEX, RolloutState
from rltool.rollout.violation import Violation

# what a reader of the warning wants to know about the fields seen most often
KNOWN_FOREIGN = {
    "response_mask": "xtuner's and verl's mask of the model's response tokens",
    "agent_loop_type": "xtuner's agent loop kind",
    "uid": "verl's prompt id",
}
RESPONSE_MASK = "response_mask"


class ForeignFieldError(ValueError):
    """A foreign field cannot be kept aside (``extra`` is not an object, or holds it)."""


def split_foreign(obj: dict[str, Any]) -> list[str]:
    """Move the keys of a JSON object that ``RolloutState`` does not define into its
    ``extra`` object, in place; returns their names in line order."""
    names = [k for k in obj if k not in RolloutState.model_fields]
    if not names:
        return names
    extra = obj.get("extra")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ForeignFieldError(
            f"fields {names} are not rltool's and would be kept in extra, but extra is not "
            "an object"
        )
    clash = [k for k in names if k in extra]
    if clash:
        raise ForeignFieldError(
            f"field {clash[0]!r} is not rltool's and extra already holds {clash[0]!r}; "
            "rename one of them"
        )
    obj["extra"] = {**extra, **{k: obj.pop(k) for k in names}}
    return names


def describe_foreign(name: str) -> str:
    """The warning for a foreign field, with a hint when it looks like a misspelt one."""
    what = KNOWN_FOREIGN.get(name)
    near = difflib.get_close_matches(name, list(RolloutState.model_fields), n=1, cutoff=0.8)
    hint = f" ({what})" if what else f"; did you mean {near[0]!r}?" if near else ""
    return (
        f"field {name!r} is not part of rltool's data contract{hint}: kept aside in "
        f"extra[{name!r}] (warned once per field name)"
    )


def check_response_mask(s: RolloutState) -> list[Violation]:
    """Where a foreign ``response_mask`` (in ``extra``) and the labels disagree; [] when
    the sample has no such mask or no labels to compare."""
    mask = (s.extra or {}).get(RESPONSE_MASK)
    if mask is None or s.labels is None:
        return []
    n_prompt = len(s.prompt_ids)
    response_labels_R = s.labels[n_prompt:]  # [R]

    def bad(message: str, position: int | None = None) -> list[Violation]:
        return [Violation(s.rollout_id, f"extra.{RESPONSE_MASK}", message, 3, position)]

    if not isinstance(mask, list) or not all(type(m) in (int, bool) for m in mask):
        return bad("response_mask must be a list of 0/1 per response token")
    mask_R = np.asarray(mask, dtype=np.int64)  # [R]
    outside = np.flatnonzero((mask_R != 0) & (mask_R != 1))
    if len(outside):
        return bad(f"response_mask holds {int(mask_R[outside[0]])}: only 0 and 1", int(outside[0]))
    if len(mask_R) != len(response_labels_R):
        return bad(
            f"response_mask has {len(mask_R)} entries but the response has "
            f"{len(response_labels_R)} tokens (labels after the {n_prompt} prompt tokens)"
        )
    supervised_R = response_labels_R != IGNORE_INDEX
    differ = np.flatnonzero(supervised_R != mask_R.astype(bool))
    if not len(differ):
        return []
    i = int(differ[0])
    said, does = ("1", "not supervised") if mask_R[i] else ("0", "supervised")
    return bad(
        f"response_mask contradicts labels at {len(differ)} response token(s): the first, "
        f"response position {i} (input position {n_prompt + i}), has mask {said} but its "
        f"label says {does}; labels are the one supervision carrier: fix whichever is wrong",
        i,
    )
