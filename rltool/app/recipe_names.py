"""Recipe names a higher layer registers (engines, agent loops, estimators, losses, group
filters, trackers, data presets), checked against their registries in the same pass as
``config/checks.py``: ``rltool train`` runs it right after loading the recipe (also with
``--print-config``), ``check_recipe`` before anything heavy; no model is loaded.

A new registry-backed key: its pattern in ``config/checks.py`` ``REGISTRY_KEYS`` and its
registry here (a test fails when the two differ).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rltool.agent_loops.base import AGENT_LOOPS
from rltool.app.trackers import TRACKERS
from rltool.config.checks import check_value, check_values, leaves, name_problem
from rltool.config.loader import raise_problems
from rltool.config.schema import RecipeConfig
from rltool.data.mapping import PRESETS
from rltool.engines.registry import ENGINES
from rltool.produce.filters import GROUP_FILTERS
from rltool.registry import Registry
from rltool.training.advantages import ESTIMATORS
from rltool.training.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS


@dataclass(frozen=True, slots=True)
class Known:
    """Where a key's names come from; ``empty`` allows "" (the default it stands for)."""

    names: Callable[[], Iterable[str]]
    kind: str
    empty: bool = False

    @classmethod
    def of(cls, registry: Registry[Any]) -> Known:
        return cls(registry.names, registry.kind)

    def known(self) -> list[str]:
        return [*([""] if self.empty else []), *self.names()]


_PRESETS = Known(lambda: sorted(PRESETS), "data preset", empty=True)
_LOOPS = Known.of(AGENT_LOOPS)

RECIPE_REGISTRIES: dict[str, Known] = {
    "rollout.engine": Known.of(ENGINES),
    "agent_loop.name": _LOOPS,
    "tasks[*].agent_loop.name": _LOOPS,
    "data.preset": _PRESETS,
    "tasks[*].preset": _PRESETS,
    "produce.group_filter": Known.of(GROUP_FILTERS),
    "algorithm.estimator": Known.of(ESTIMATORS),
    "algorithm.loss_agg": Known.of(LOSS_AGGREGATIONS),
    "algorithm.kl_estimator": Known.of(KL_ESTIMATORS),
    "logging.trackers[*]": Known.of(TRACKERS),
}


def name_problems(recipe: RecipeConfig) -> list[str]:
    """One line per registry-backed key whose value is not a registered name."""
    problems = []
    for key, pattern, value in leaves(recipe):
        known = RECIPE_REGISTRIES.get(pattern)
        if known is not None and value not in known.known():
            problems.append(name_problem(key, value, known.known(), known.kind))
    return problems


def check_config(recipe: RecipeConfig, source: str = "recipe") -> None:
    """The whole pass: one ValueError listing every value out of its range or names
    (``config/checks.py``, which ``load_recipe`` ran already) and every registry-backed
    name that is not registered."""
    raise_problems([*check_values(recipe), *name_problems(recipe)], source)


def option_problem(key: str, value: Any) -> str | None:
    """The problem of one recipe key's value given another way (a command-line option of
    ``inspect-batch``): its range, names or registry; None when it is good."""
    known = RECIPE_REGISTRIES.get(key)
    if known is None:
        return check_value(key, value)
    return None if value in known.known() else name_problem(key, value, known.known(), known.kind)
