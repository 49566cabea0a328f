"""The house's layers import only downward (docs/architecture.md): every ``rltool`` import
of every module, read from its source, checked against the layer table below."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "rltool"

# package or module -> layer, with no exceptions inside a package (no entry lies inside
# another). A module may import its own layer and the layers below it, never above.
LAYERS: dict[str, int] = {
    "rltool.config": 0,
    "rltool.registry": 0,
    "rltool.packing": 0,
    "rltool.metric_names": 0,  # metric names read beyond their producer
    "rltool.builtin": 0,  # builtin: paths (names and directories, nothing imported)
    "rltool.rollout": 1,
    "rltool.engines": 2,
    "rltool.rewards": 2,
    "rltool.models": 2,
    "rltool.lora": 2,  # LoRA adapters on a model (peft)
    "rltool.lora_sync": 2,  # what a weight sync sends: adapters or merged weights
    "rltool.moe": 2,
    "rltool.data": 2,
    "rltool.demo": 2,  # the demo's data and tokenizer (its model's builder is app.demo_model)
    "rltool.agent_loops": 3,
    "rltool.sessions": 3,
    "rltool.sandbox": 3,
    "rltool.verl_compat": 3,
    "rltool.agents": 3,
    "rltool.produce": 4,
    "rltool.training": 4,
    "rltool.app": 5,
    "rltool.cli": 6,
    "rltool.report": 6,
}
# same layer, but neither may import the other
SIBLINGS = [("rltool.produce", "rltool.training")]


def _layer(module: str) -> int:
    (entry,) = [p for p in LAYERS if module == p or module.startswith(p + ".")] or [None]
    assert entry, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return LAYERS[entry]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every rltool import in the file, lazy ones inside functions too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            target = names[0]
            # `from rltool.app import run` imports rltool.app.run
            if node.module in ("rltool", *LAYERS):
                target = max(names, key=lambda n: _known(n))
            out.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(line, m) for line, m in out if m == "rltool" or m.startswith("rltool.")]


def _known(module: str) -> int:
    return max((len(p) for p in LAYERS if module == p or module.startswith(p + ".")), default=0)


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _module_name(path)
        if here == "rltool":
            continue
        for line, target in _imports(path):
            if target == "rltool":
                continue
            if _layer(target) > _layer(here):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {here} imports {target}")
            for a, b in SIBLINGS:
                for x, y in ((a, b), (b, a)):
                    if here.startswith(x + ".") and (target == y or target.startswith(y + ".")):
                        bad.append(
                            f"{path.relative_to(PACKAGE.parent)}:{line}: {here} imports {target}"
                        )
    return bad


def test_layers_import_only_downward() -> None:
    assert _violations() == []


def test_no_module_is_an_exception_to_its_package():
    nested = [(a, b) for a in LAYERS for b in LAYERS if b.startswith(a + ".")]
    assert nested == []


@pytest.mark.parametrize(
    ("module", "layer"),
    [("rltool.app.demo_model", 5), ("rltool.demo.data", 2), ("rltool.builtin", 0)],
)
def test_a_module_takes_its_packages_layer(module: str, layer: int) -> None:
    assert _layer(module) == layer


def test_importing_models_does_not_import_the_demo():
    """``builtin:`` model paths resolve through rltool.builtin: loading a model needs none
    of the demo's data, tokenizer or builder."""
    code = "import sys, rltool.models; print(sorted(m for m in sys.modules if 'demo' in m))"
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
