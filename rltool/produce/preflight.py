"""Preflight: what every task of a recipe needs (its loop's options and programs, its data
files and the record fields its loop reads), checked before any model loads.

Design: docs/agent-loops.md#preflight
"""

from __future__ import annotations

from collections.abc import Sequence

from rltool.agent_loops.base import AGENT_LOOPS, AgentLoop
from rltool.data.mapping import FieldMap
from rltool.produce.task_specs import TASK_NAME_OPTION, TaskSpec, generator_located

MAX_RECORDS_NAMED = 3  # bad records named per data file; the rest are counted


class PreflightError(ValueError):
    """The recipe's tasks or data cannot run: refused before the model loads (exit 2)."""


def check_preflight(specs: Sequence[TaskSpec]) -> None:
    """One PreflightError listing every problem of every task, or nothing."""
    problems = preflight_problems(specs)
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise PreflightError(
            f"preflight: {len(problems)} problem(s) to fix before the model loads:\n{listing}"
        )


def preflight_problems(specs: Sequence[TaskSpec]) -> list[str]:
    """Every task's problems, once each; a problem of some tasks of a ``tasks:`` list is
    prefixed with them (``tasks[1] (task 'code'): ...``)."""
    found: dict[str, list[str]] = {}  # problem -> the tasks that have it, in order
    for spec in specs:
        label = "" if spec.where == "agent_loop" else f"{spec.where} (task {spec.name!r})"
        for problem in task_problems(spec):
            found.setdefault(problem, []).append(label)
    return [f"{', '.join(labels)}: {p}" if all(labels) else p for p, labels in found.items()]


def task_problems(spec: TaskSpec) -> list[str]:
    """One task's problems: options, the machine, then each data file."""
    loop_cls = AGENT_LOOPS.get(spec.loop.name)
    options = {k: v for k, v in spec.loop.options.items() if k != TASK_NAME_OPTION}
    try:
        loop_cls.check_options(options)
    except ValueError as exc:
        return [str(exc)]  # the loop's own checks would misread options it does not take
    problems = list(loop_cls.preflight(options))
    if spec.generator is not None:
        return problems + generator_problems(loop_cls, spec)
    for path in dict.fromkeys([*spec.train_files, *spec.eval_files]):
        problems += data_file_problems(loop_cls, path, spec.fields)
    return problems


def generator_problems(loop_cls: type[AgentLoop], spec: TaskSpec) -> list[str]:
    """A generator task's rows can be drawn (its package installed, its config valid, the
    seed ranges disjoint) and its loop reads them."""
    try:
        rows = [*generator_located(spec, False), *generator_located(spec, True)]
    except ValueError as exc:
        return [str(exc)]
    bad = [p for where, r in rows if (p := loop_cls.record_problem(r, where)) is not None]
    return bad[:MAX_RECORDS_NAMED]


def data_file_problems(
    loop_cls: type[AgentLoop], path: str, fields: FieldMap | None = None
) -> list[str]:
    """The file exists and holds records mapped by ``fields`` (``rltool.data``'s check:
    a missing mapped field is named by its dotted path), each readable by the loop
    (``record_problem``): the first bad records named with their index, the rest counted."""
    from rltool.data import load_examples  # lazy: builtin paths pull in the model stack

    try:
        records = load_examples([path], fields)
    except ValueError as exc:
        return [str(exc)]
    bad = []
    for i, record in enumerate(records):
        problem = loop_cls.record_problem(record, f"data file {path} record {i}")
        if problem is not None:
            bad.append(problem)
    if len(bad) > MAX_RECORDS_NAMED:
        more = len(bad) - MAX_RECORDS_NAMED
        bad = [*bad[:MAX_RECORDS_NAMED], f"data file {path}: {more} more record(s) like these"]
    return bad
