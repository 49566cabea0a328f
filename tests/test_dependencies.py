"""Every third-party module rltool imports is a declared dependency (issue 21: `pip install
rltool` imported httpx, which no declared dependency brought, and every `rltool train` died).

Read from the source like tests/test_layers.py: each import's top-level module is either
the standard library, a runtime dependency of pyproject.toml, or an optional one (an
extra, or a package that lives in its own environment) imported lazily: inside a
function, under ``if TYPE_CHECKING:`` or in a ``try`` that catches ImportError, so that a
plain install never meets it at import time. CI checks the same end to end: .ci/run
installs the wheel without extras into a fresh venv and trains one step.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "rltool"

# Packages that cannot share rltool's environment (their pins conflict); each has its own,
# built by the script named here.
SEPARATE_ENVIRONMENTS = {"vllm": "scripts/vllm_env.sh", "verl": "scripts/verl_env.sh"}
# A distribution that a declared one pins exactly, so declaring it would only repeat the pin.
COVERED_BY = {"pydantic-core": "pydantic"}
# A module whose distribution has another name, for where it is not installed to be looked up.
DISTRIBUTION_OF = {"openenv": "openenv-core"}
# Modules that are only ever loaded inside a separate environment, never by rltool's
# imports, so their top-level import of that environment's package is no risk.
LOADED_ONLY_THERE = {
    "rltool/verl_compat/calculator_tool.py": "verl's tool registry loads it from a tool config",
}
_LAZY_HANDLERS = {"ImportError", "ModuleNotFoundError"}


def _norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_norm(re.match(r"[A-Za-z0-9._-]+", r.strip()).group(0)) for r in requirements}


def _declared() -> tuple[set[str], set[str]]:
    """(runtime dependencies, optional ones: every extra) as normalised names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for reqs in project.get("optional-dependencies", {}).values() for r in reqs]
    return _requirement_names(project["dependencies"]), _requirement_names(extras)


@functools.cache
def _installed() -> dict[str, list[str]]:
    return packages_distributions()  # scans every installed distribution: once


def _distributions(module: str) -> list[str]:
    """The distributions that provide a top-level module (as installed; else the module's
    own name, the usual spelling)."""
    return [_norm(d) for d in _installed().get(module, [DISTRIBUTION_OF.get(module, module)])]


def _is_lazy(parents: list[ast.AST]) -> bool:
    for node in parents:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return True
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
        if isinstance(node, ast.Try):
            caught = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
            names = {n.strip("() ") for c in caught for n in c.split(",")}
            if names & _LAZY_HANDLERS:
                return True
    return False


def _third_party_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, top-level module, lazy?) of every absolute non-stdlib, non-rltool import."""
    out: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, parents: list[ast.AST]) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.partition(".")[0]
            if top != "rltool" and top not in sys.stdlib_module_names and top != "__future__":
                out.append((node.lineno, top, _is_lazy(parents)))
        for child in ast.iter_child_nodes(node):
            visit(child, [*parents, node])

    visit(ast.parse(path.read_text(), str(path)), [])
    return out


def _problems() -> list[str]:
    runtime, optional = _declared()
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, module, lazy in _third_party_imports(path):
            dists = {COVERED_BY.get(d, d) for d in _distributions(module)}
            where = f"{rel}:{line}: import of {module}"
            if dists & runtime:
                continue
            if module in SEPARATE_ENVIRONMENTS or dists & optional:
                if not lazy and rel not in LOADED_ONLY_THERE:
                    problems.append(
                        f"{where} (optional) at import time: import it inside the function "
                        "that needs it, or catch ImportError with the install hint"
                    )
                continue
            problems.append(
                f"{where}: {sorted(dists)} is not declared; add it to pyproject.toml's "
                "dependencies (or an extra, imported lazily)"
            )
    return problems


def test_every_import_is_a_declared_dependency() -> None:
    assert _problems() == []


def test_the_check_sees_an_undeclared_and_an_eager_optional_import(tmp_path, monkeypatch) -> None:
    """The checker itself: an undeclared module and an extra imported at the top fail; a
    lazy extra and a guarded separate-environment import pass."""
    pkg = tmp_path / "rltool"
    pkg.mkdir()
    (pkg / "bad.py").write_text("import httpx\nimport peft\n")
    (pkg / "good.py").write_text(
        "import json\nimport torch\n"
        "def f():\n    import peft\n"
        "try:\n    import vllm\nexcept ImportError:\n    vllm = None\n"
    )
    (tmp_path / "pyproject.toml").write_text(
        '[project]\ndependencies = ["torch>=2"]\n[project.optional-dependencies]\nlora = ["peft"]\n'
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    problems = _problems()
    assert len(problems) == 2, problems
    assert problems[0].startswith("rltool/bad.py:1: import of httpx: ['httpx'] is not declared")
    assert problems[1].startswith("rltool/bad.py:2: import of peft (optional) at import time")


def test_separate_environments_have_their_scripts() -> None:
    for module, script in SEPARATE_ENVIRONMENTS.items():
        assert (ROOT / script).is_file(), f"{module}: {script} is missing"


def test_modules_loaded_only_in_another_environment_are_not_imported_by_rltool() -> None:
    dotted = {p.removesuffix(".py").replace("/", ".") for p in LOADED_ONLY_THERE}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            assert not dotted & set(names), f"{path}:{node.lineno} imports {dotted & set(names)}"
