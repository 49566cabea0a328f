"""Rollout engines by name: ``rollout.engine`` in a recipe picks one.

An engine registers a builder under its name in the module that defines it
(``@ENGINES.register("hf")``); ``build_engine`` is the one place an engine is
built. A module that registers an engine imports its heavy dependencies inside
the builder, so the recipe check (``app/recipe_names.py``) lists every engine without them.
"""

from __future__ import annotations

from typing import Any, Protocol

from rltool.config.schema import ModelConfig, RolloutConfig
from rltool.engines.base import RolloutEngine
from rltool.registry import Registry


class EngineBuilder(Protocol):
    def __call__(
        self, rollout: RolloutConfig, model_cfg: ModelConfig, model: Any, tokenizer: Any
    ) -> RolloutEngine:
        """The engine of ``rollout``. ``model`` is the policy already loaded in this process
        (None where the engine loads its own weights from ``model_cfg.path``)."""


ENGINES: Registry[EngineBuilder] = Registry(
    "rollout engine",
    "rollout.engine",
    builtin_modules=("rltool.engines.hf", "rltool.engines.openai_server", "rltool.engines.vllm"),
)


def build_engine(
    rollout: RolloutConfig, model_cfg: ModelConfig, model: Any, tokenizer: Any
) -> RolloutEngine:
    """The engine ``rollout.engine`` names, built on ``model`` (or on ``model_cfg``)."""
    return ENGINES.get(rollout.engine)(rollout, model_cfg, model, tokenizer)
