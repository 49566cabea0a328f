"""Recipe loading: YAML fragments + recipe body + command-line overrides -> RecipeConfig.

Merge order (later wins): the fragments named by the recipe's top-level
``defaults:`` list, in order (each fragment's own ``defaults`` first), then the
recipe body, then the dotlist overrides (``trainer.steps=5``). Fragments are
written with full keys from the root (``optimizer: {lr: 3e-4}``), so a key
reads the same wherever it appears.

Every value is checked against the typed schema as it is applied, so an
unknown key or a value of the wrong type is a ValueError naming the full key,
the file it came from (or the command line) and, for a misspelling, the
nearest valid key. The merged values are then checked against their ranges and names
(``config/checks.py``), all bad keys reported at once. Nothing after loading sees a raw DictConfig.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rltool.config.checks import check_values, combination_problems
from rltool.config.correction import form_problems
from rltool.config.schema import RecipeConfig

CONFIGS_DIRNAME = "configs"
RECIPES_DIRNAME = "recipes"
# rltool's own fragments (model/tiny, algorithm/grpo, ...), shipped inside the package so
# that a recipe finds them from any directory, whatever the install.
PACKAGE_CONFIGS = Path(__file__).resolve().parents[1] / CONFIGS_DIRNAME
# The checkout the package sits in (its recipes/), for the tests of the shipped recipes.
_REPO_ROOT = Path(__file__).resolve().parents[2]


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Load a recipe file, its fragments and the overrides into a RecipeConfig."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe {path} does not exist")
    cfg = OmegaConf.structured(RecipeConfig)
    _apply_file(cfg, path, _config_dirs(path), chain=())
    for item in overrides:
        _apply(cfg, _parse_override(item), RecipeConfig, "", f"command line override {item!r}")
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:  # e.g. a broken ${interpolation}
        raise ValueError(f"recipe {path}: {_first_line(exc)}") from exc
    assert isinstance(obj, RecipeConfig)
    check_recipe_values(obj, f"recipe {path}")
    return obj


def check_recipe_values(cfg: RecipeConfig, source: str) -> None:
    """ValueError listing every key out of its range or not one of its names, and every
    threshold of the wrong form in ``algorithm.rollout_correction`` (``source`` names the
    recipe), and every pair of keys that cannot go together."""
    problems = check_values(cfg) + form_problems(cfg.algorithm) + combination_problems(cfg)
    raise_problems(problems, source)


def raise_problems(problems: list[str], source: str) -> None:
    """One ValueError for the lines of ``config/checks.py``-style problems, if any."""
    if len(problems) == 1:
        raise ValueError(f"{source}: {problems[0]}")
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise ValueError(f"{source}: {len(problems)} bad values:\n{lines}")


def recipe_to_yaml(cfg: RecipeConfig) -> str:
    """The fully resolved recipe as YAML (what ``--print-config`` shows)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


RUN_CONFIG = "config.yaml"  # a run's resolved recipe, in its run directory


def config_changes(old: RecipeConfig, new: RecipeConfig) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` for every full key whose value differs."""
    a, b = _flat(_container(old)), _flat(_container(new))
    missing = _Absent()
    return [
        (key, a.get(key, missing), b.get(key, missing))
        for key in sorted(a.keys() | b.keys())
        if a.get(key, missing) != b.get(key, missing)
    ]


def format_changes(changes: list[tuple[str, Any, Any]]) -> str:
    return "\n".join(f"  {key}: {old!r} -> {new!r}" for key, old, new in changes)


def resume_recipe(
    run_dir: str | Path, overrides: Sequence[str] = (), recipe: str | Path | None = None
) -> RecipeConfig:
    """The recipe a resumed run continues with: the run's own ``config.yaml`` with the
    overrides applied. A ``recipe`` given as well must resolve (with the same overrides)
    to that same config; a ValueError lists every difference otherwise."""
    saved = Path(run_dir) / RUN_CONFIG
    if not saved.is_file():
        raise ValueError(
            f"--resume {run_dir}: {saved} is missing; give the directory of a run that "
            "rltool train made (runs/<name>)"
        )
    current = load_recipe(saved, overrides)
    if recipe is not None:
        diff = config_changes(current, load_recipe(recipe, overrides))
        if diff:
            raise ValueError(
                f"recipe {recipe} differs from the run's {saved} (key: run value -> recipe "
                f"value):\n{format_changes(diff)}\nto continue the run as it was, leave the "
                f"recipe out: rltool train --resume {run_dir} [key=value ...]"
            )
    return current


class _Absent:
    """A key one config has and the other lacks (an extra ``tasks`` item)."""

    def __repr__(self) -> str:
        return "(absent)"


def _container(cfg: RecipeConfig) -> dict[str, Any]:
    raw = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(raw, dict)
    return raw


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Full keys to leaf values; a list of sections (``tasks``) by item: ``tasks[0].weight``."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out |= _flat(value, f"{prefix}.{key}" if prefix else str(key))
        return out
    if isinstance(tree, list) and tree and all(isinstance(x, dict) for x in tree):
        out = {}
        for i, item in enumerate(tree):
            out |= _flat(item, f"{prefix}[{i}]")
        return out
    return {prefix: tree}


def find_recipes(root: str | Path | None = None) -> list[Path]:
    """Every recipe YAML under ``<root>/recipes`` (default: the checkout's)."""
    base = Path(root) if root is not None else _REPO_ROOT
    return sorted((base / RECIPES_DIRNAME).glob("*.yaml"))


# --- files and fragments ---------------------------------------------------------------


def _config_dirs(recipe: Path) -> list[Path]:
    """Where fragments are looked up: every ``configs/`` dir from the recipe's folder
    upward (nearest first), then rltool's own (``rltool/configs``)."""
    dirs = [d / CONFIGS_DIRNAME for d in recipe.resolve().parents]
    dirs.append(PACKAGE_CONFIGS)
    return list(dict.fromkeys(d for d in dirs if d.is_dir()))


def _find_fragment(name: str, dirs: list[Path], source: Path) -> Path:
    rel = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    for d in dirs:
        if (d / rel).is_file():
            return d / rel
    searched = ", ".join(str(d) for d in dirs) or f"no {CONFIGS_DIRNAME}/ directory found"
    known = sorted(
        {p.relative_to(d).with_suffix("").as_posix() for d in dirs for p in d.rglob("*.yaml")}
    )
    near = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f"; known fragments: {', '.join(known)}"
    raise ValueError(f"{source}: defaults entry {name!r} not found (searched {searched}){hint}")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and OmegaConf's own, reported with the file
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"{path}: top level must be a mapping of recipe sections")
    raw = OmegaConf.to_container(loaded, resolve=False)
    assert isinstance(raw, dict)
    return raw


def _apply_file(cfg: DictConfig, path: Path, dirs: list[Path], chain: tuple[Path, ...]) -> None:
    """Apply a file's defaults (recursively), then its body."""
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ValueError(f"defaults form a cycle: {cycle}")
    raw = _read_yaml(path)
    defaults = raw.pop("defaults", [])
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ValueError(
            f"{path}: defaults must be a list of fragment names like [model/tiny, algorithm/grpo]"
        )
    for name in defaults:
        _apply_file(cfg, _find_fragment(name, dirs, path), dirs, (*chain, path.resolve()))
    _apply(cfg, raw, RecipeConfig, "", str(path))


def _parse_override(item: str) -> dict[str, Any]:
    key, sep, _ = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"command line override {item!r} is not of the form key=value")
    raw = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    assert isinstance(raw, dict)
    return raw


# --- schema-checked application ---------------------------------------------------------


@functools.cache
def _field_types(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


@functools.cache
def _all_keys(schema: type = RecipeConfig, prefix: str = "") -> tuple[str, ...]:
    """Every full key of the schema, sections and leaves."""
    out: list[str] = []
    for name, typ in _field_types(schema).items():
        out.append(prefix + name)
        if dataclasses.is_dataclass(typ):
            out.extend(_all_keys(typ, f"{prefix}{name}."))
    return tuple(out)


def _apply(
    cfg: DictConfig,
    raw: dict[str, Any],
    schema: type,
    prefix: str,
    source: str,
    node_prefix: str | None = None,
) -> None:
    """Assign ``raw`` onto ``cfg`` one schema field at a time, so any error names its key.

    ``prefix`` is the key as the user reads it (``tasks[0].weight``), ``node_prefix``
    its path inside ``cfg`` (default: the same)."""
    node_prefix = prefix if node_prefix is None else node_prefix
    fields = _field_types(schema)
    for key, value in raw.items():
        full, node_key = f"{prefix}{key}", f"{node_prefix}{key}"
        if key not in fields:
            raise ValueError(_unknown_key_message(full, str(key), fields, source))
        typ = fields[key]
        if dataclasses.is_dataclass(typ):
            shorthand = getattr(typ, "SHORTHAND", None)  # `section=name` for `section.<key>=name`
            if shorthand is not None and isinstance(value, str):
                value = {shorthand: value}
            if value is None:  # an empty section (`trainer:` with every key commented out)
                continue
            if not isinstance(value, dict):
                raise ValueError(
                    f"{source}: {full} is a section ({typ.__name__}) and takes a mapping of its "
                    f"keys, got {value!r}"
                )
            _apply(cfg, value, typ, full + ".", source, node_key + ".")
            continue
        item_schema = _list_item_schema(typ)
        if item_schema is not None and value is not None:
            _apply_list(cfg, value, item_schema, full, node_key, source)
            continue
        try:
            OmegaConf.update(cfg, node_key, value, merge=True)
        except OmegaConfBaseException as exc:
            raise ValueError(
                f"{source}: {full} expects {_type_name(typ)}, got {value!r} ({_first_line(exc)})"
            ) from exc


def _list_item_schema(typ: Any) -> type | None:
    """The dataclass of a ``list[<dataclass>]`` field (``tasks``), else None."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _apply_list(
    cfg: DictConfig, value: Any, item: type, full: str, node_key: str, source: str
) -> None:
    """A list of sections, each item checked like a section: errors name ``tasks[1].wieght``.

    A YAML list replaces the whole list; a dotlist override ``tasks.0.weight=2`` arrives
    as ``{"0": {"weight": 2}}`` and edits an item the recipe already lists."""
    if isinstance(value, dict):
        current = OmegaConf.select(cfg, node_key)
        for idx, raw_item in value.items():
            if not str(idx).isdigit() or int(idx) >= len(current):
                raise ValueError(
                    f"{source}: {full}.{idx}: no such item; the recipe lists {len(current)} "
                    f"{full} (indices 0..{len(current) - 1})"
                )
            where = f"{full}[{int(idx)}]"
            if not isinstance(raw_item, dict):
                raise ValueError(
                    f"{source}: {where} is a section ({item.__name__}), got {raw_item!r}"
                )
            _apply(cfg, raw_item, item, where + ".", source, f"{node_key}.{int(idx)}.")
        return
    if not isinstance(value, list):
        raise ValueError(
            f"{source}: {full} takes a list of {item.__name__} mappings, got {value!r}"
        )
    checked = []
    for i, raw_item in enumerate(value):
        if not isinstance(raw_item, dict):
            raise ValueError(
                f"{source}: {full}[{i}] must be a mapping of {item.__name__} keys, got {raw_item!r}"
            )
        node = OmegaConf.structured(item)
        _apply(node, raw_item, item, f"{full}[{i}].", source, "")
        checked.append(node)
    OmegaConf.update(cfg, node_key, checked, merge=False)


def _unknown_key_message(full: str, key: str, fields: dict[str, Any], source: str) -> str:
    section = full.rpartition(".")[0]
    near = difflib.get_close_matches(key, list(fields), n=1)
    if near:
        suggestion = f"{section}.{near[0]}" if section else near[0]
    elif "[" not in full:  # maybe the right key in the wrong section (trainer.lr -> optimizer.lr)
        elsewhere = [k for k in _all_keys() if k.rpartition(".")[2] == key]
        suggestion = elsewhere[0] if elsewhere else None
    else:  # inside a list item (tasks[0].lr): a key of another section is no answer
        suggestion = None
    hint = f"; did you mean {suggestion!r}?" if suggestion else ""
    where = f"'{section}'" if section else "a recipe"
    return f"{source}: unknown key {full!r}{hint} (valid keys in {where}: {', '.join(fields)})"


def _type_name(typ: Any) -> str:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(
            "null" if a is type(None) else _type_name(a) for a in typing.get_args(typ)
        )
    if origin is None and isinstance(typ, type):
        return typ.__name__
    return str(typ).replace("typing.", "")


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
