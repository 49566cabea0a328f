"""One registry style for every pluggable kind: agent loops, engines, estimators, losses.

A ``Registry`` maps the name a recipe uses to the thing it builds; an unknown name is a
ValueError that lists the known names. Design: docs/foundations.md#the-registry
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, recipe_key: str, builtin_modules: Sequence[str] = ()) -> None:
        self.kind = kind  # e.g. "agent loop", in error messages
        self.recipe_key = recipe_key  # e.g. "agent_loop.name"
        self._builtin_modules = tuple(builtin_modules)
        self._loaded = not self._builtin_modules
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make ``entry`` available under ``name``."""

        def wrap(entry: T) -> T:
            if name in self._entries and self._entries[name] is not entry:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return wrap

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._entries)

    def get(self, name: str) -> T:
        """The entry of ``name``, or a ValueError naming the recipe key and the known names."""
        self._load_builtins()
        if name not in self._entries:
            known = ", ".join(sorted(self._entries)) or "none"
            raise ValueError(f"{self.recipe_key}: unknown {self.kind} {name!r}; known: {known}")
        return self._entries[name]

    def __contains__(self, name: str) -> bool:
        self._load_builtins()
        return name in self._entries

    def _load_builtins(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # before importing: a module that looks itself up does not recurse
        for module in self._builtin_modules:
            importlib.import_module(module)  # runs the modules' @register decorators
