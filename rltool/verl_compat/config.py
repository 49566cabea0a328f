"""What a verl-style agent loop reads at construction: its config, its tools, its class.

The wrappers carry the same attributes as verl's, so the loops cannot tell them apart.
Design: docs/agent-loops.md#the-loops-configuration
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rltool.builtin import builtin_file, is_builtin
from rltool.config.schema import SamplingConfig

# verl 0.9's MultiTurnConfig defaults, for the keys its loops read
DEFAULT_MULTI_TURN: dict[str, Any] = {
    "enable": True,
    "max_assistant_turns": None,
    "max_user_turns": None,
    "max_parallel_calls": 1,
    "max_tool_response_length": 256,
    "tool_response_truncate_side": "middle",
    "format": "hermes",
    "tool_config_path": None,
    "function_tool_path": None,
}


@dataclass(slots=True)
class ConfigWrap:
    """verl's ``DictConfigWrap``: a config the loop finds at ``.config``."""

    config: DictConfig


@dataclass(slots=True)
class ToolListWrap:
    """verl's ``ToolListWrap``: the tool objects at ``.tools``."""

    tools: list[Any]


def trainer_config(
    *,
    prompt_length: int,
    response_length: int,
    sampling: SamplingConfig,
    multi_turn: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> DictConfig:
    """The verl-shaped trainer config a loop reads, with ``overrides`` merged on top."""
    if prompt_length < 1 or response_length < 1:
        raise ValueError(
            f"agent_loop.options: prompt_length ({prompt_length}) and response_length "
            f"({response_length}) must be >= 1"
        )
    rollout = {
        "name": "rltool",
        "prompt_length": prompt_length,
        "response_length": response_length,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "calculate_log_probs": True,
        "full_determinism": False,
        "multi_turn": {**DEFAULT_MULTI_TURN, **(multi_turn or {})},
    }
    base = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": rollout}, "data": {"apply_chat_template_kwargs": {}}}
    )
    merged = OmegaConf.merge(base, OmegaConf.create(overrides or {}))
    assert isinstance(merged, DictConfig)
    return merged


def load_loop_class(path: str) -> type:
    """The agent-loop class at ``package.module.Class`` (or ``package.module:Class``)."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"agent_loop.options.loop_class {path!r} is not an import path; "
            f"write it as package.module.ClassName"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = (
            " (verl's loops need verl: run scripts/verl_env.sh)" if path.startswith("verl.") else ""
        )
        raise ValueError(
            f"agent_loop.options.loop_class: cannot import {module_name!r}: {exc}{hint}"
        ) from exc
    cls = getattr(module, attr, None)
    if not inspect.isclass(cls):
        raise ValueError(f"agent_loop.options.loop_class: {module_name!r} has no class {attr!r}")
    if not inspect.iscoroutinefunction(getattr(cls, "run", None)):
        raise ValueError(
            f"agent_loop.options.loop_class: {path} has no `async def run(self, sampling_params, "
            f"**kwargs)`; it is not a verl agent loop"
        )
    return cls


def is_verls_own(path: str) -> bool:
    """Whether an import path names a module of verl itself (``verl.*``)."""
    return path == "verl" or path.startswith(("verl.", "verl:"))


def loop_class_problems(path: Any, multi_turn: Any) -> list[str]:
    """What keeps ``loop_class`` (and verl tool configs in ``multi_turn``) from loading, as
    fix-it sentences; verl's own classes are checked for verl being installed, not imported."""
    if not isinstance(path, str):
        return []  # a missing or mistyped option: check_options says so
    tools = isinstance(multi_turn, dict) and any(
        multi_turn.get(k) for k in ("tool_config_path", "function_tool_path")
    )
    if is_verls_own(path) or tools:
        if importlib.util.find_spec("verl") is None:
            needs = f"loop_class {path}" if is_verls_own(path) else "verl tool configs"
            return [
                f"agent_loop.options: {needs} needs verl, which is not installed: run "
                "scripts/verl_env.sh (verl needs its own environment, see docs/agent-loops.md)"
            ]
        if is_verls_own(path):
            return []
    try:
        load_loop_class(path)
    except ValueError as exc:
        return [str(exc)]
    return []


BUILTIN_DIR = Path(__file__).parent  # tool configs shipped with rltool


def resolve_tool_path(path: str | None) -> str | None:
    """``builtin:NAME`` -> the file NAME shipped in rltool/verl_compat/; other paths unchanged."""
    if not path or not is_builtin(path):
        return path
    return str(builtin_file(path, BUILTIN_DIR, "*.yaml", "builtin tool config"))


def load_tools(tool_config_path: str | None, function_tool_path: str | None) -> list[Any]:
    """verl tools from a tool config YAML and/or a function-tool file, loaded the way verl does."""
    if not tool_config_path and not function_tool_path:
        return []
    try:
        from verl.tools.tool_registry import load_all_tools
    except ImportError as exc:
        raise ValueError(
            "agent_loop.options.multi_turn.tool_config_path / function_tool_path are verl tool "
            f"configs and need verl installed (run scripts/verl_env.sh): {exc}"
        ) from exc
    tools = load_all_tools(
        tool_config_path=resolve_tool_path(tool_config_path),
        function_tool_path=resolve_tool_path(function_tool_path),
    )
    return list(tools)
