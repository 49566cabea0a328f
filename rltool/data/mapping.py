"""Where a record's prompt, answer and task come from (dotted paths), with presets, and the
mapping of a raw record to the one canonical row every loop reads.

Design: docs/foundations.md#task-records
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass(frozen=True)
class FieldMap:
    """Dotted paths into a record; ``task`` empty means no task field is read."""

    prompt: str = "question"
    answer: str = "answer"
    task: str = ""

    def is_identity(self) -> bool:
        return self == FieldMap()


PRESETS: dict[str, FieldMap] = {
    "gsm8k": FieldMap("question", "answer", ""),
    "verl": FieldMap("prompt", "reward_model.ground_truth", "data_source"),
    # rows drawn from a generator (data/reasoning_gym.py), already canonical
    "reasoning_gym": FieldMap("question", "answer", ""),
}


def field_map(
    preset: str = "",
    prompt_key: str = "",
    answer_key: str = "",
    task_key: str = "",
    where: str = "data",
) -> FieldMap:
    """The preset's paths (default ``gsm8k``), each overridden by a non-empty key; the
    preset name was checked when the recipe loaded (app/recipe_names.py)."""
    base = PRESETS[preset or "gsm8k"]
    keys = {"prompt_key": prompt_key, "answer_key": answer_key, "task_key": task_key}
    for key, value in keys.items():
        if value and (value != value.strip() or not all(value.split("."))):
            raise ValueError(
                f"{where}.{key} {value!r} must be a dotted path like 'reward_model.ground_truth'"
            )
    return FieldMap(
        prompt=prompt_key or base.prompt,
        answer=answer_key or base.answer,
        task=task_key or base.task,
    )


def lookup(record: Any, path: str) -> Any:
    """The value at the dotted ``path`` of ``record``, or ``_MISSING``."""
    value = record
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def map_record(record: Any, fields: FieldMap, where: str) -> dict[str, Any]:
    """The canonical row: the record's own fields plus ``question`` (a prompt string) or
    ``messages`` (a prompt given as chat messages), ``answer`` and, when mapped, ``task``."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    prompt = _required(record, fields.prompt, where, "prompt")
    answer = _required(record, fields.answer, where, "answer")
    row = dict(record)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: {fields.prompt!r} must be a non-empty string")
        row["question"] = prompt
    elif isinstance(prompt, list):
        row["messages"] = _messages(prompt, fields.prompt, where)
    else:
        kind = type(prompt).__name__
        raise ValueError(
            f"{where}: prompt field {fields.prompt!r} must be a string or a list of chat "
            f"messages, got {kind}"
        )
    if not isinstance(answer, str | int | float) or isinstance(answer, bool):
        kind = type(answer).__name__
        raise ValueError(
            f"{where}: answer field {fields.answer!r} must be a string or a number, got {kind}"
        )
    row["answer"] = answer
    if fields.task:
        task = _required(record, fields.task, where, "task")
        if not isinstance(task, str) or not task:
            raise ValueError(f"{where}: task field {fields.task!r} must be a non-empty string")
        row["task"] = task
    return row


def _required(record: dict, path: str, where: str, role: str) -> Any:
    value = lookup(record, path)
    if value is _MISSING or value is None:
        have = ", ".join(sorted(record)) or "none"
        raise ValueError(
            f"{where}: missing field {path!r} (fields present: {have}); if the {role} is "
            f"named otherwise, set the recipe's data.{role}_key or data.preset"
        )
    return value


def _messages(value: list, path: str, where: str) -> list[dict[str, str]]:
    if not value:
        raise ValueError(f"{where}: prompt field {path!r} is an empty list of messages")
    out = []
    for j, m in enumerate(value):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ValueError(
                f"{where}: prompt field {path!r} message {j} must have string 'role' and "
                f"'content', got {m!r}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out
