"""scripts/gpu_check.sh and its checks, on the CPU: the arguments, the list, the table and
its exit status with fake check results, the checks that run on the CPU, the skips of the
others; scripts/gpu_wheels.sh's requirements from pyproject.toml (nothing downloaded)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from rltool.app import gpu_check as gc
from rltool.app import gpu_checks

ROOT = Path(__file__).parents[2]
NAMES = [
    "cuda", "bf16", "flex-block", "flash-varlen", "activation-checkpointing", "fsdp2-nccl",
    "hf-engine", "demo-20",
]  # fmt: skip
CPU_RUNS = ["bf16", "activation-checkpointing", "hf-engine"]  # the others need CUDA
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skips without CUDA")


def shell(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


def test_dry_run_lists_every_check_and_runs_nothing() -> None:
    done = shell("gpu_check.sh", "--dry-run")
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines()]
    assert listed == NAMES == [k.name for k in gc.CHECKS]
    assert "running" not in done.stderr


def test_dry_run_imports_no_torch() -> None:
    code = "import sys; from rltool.app.gpu_check import main; main(['--dry-run']); "
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_help_and_bad_arguments() -> None:
    helped = shell("gpu_check.sh", "--help")
    assert helped.returncode == 0 and "--wheels DIR" in helped.stdout
    unknown = shell("gpu_check.sh", "--fast")
    assert unknown.returncode == 2 and "unknown argument '--fast'" in unknown.stderr
    missing = shell("gpu_check.sh", "--dry-run", "--wheels")
    assert missing.returncode == 2 and "--wheels needs a directory" in missing.stderr
    not_dir = shell("gpu_check.sh", "--wheels", str(ROOT / "no-such-dir"))
    assert not_dir.returncode == 2 and "is not a directory" in not_dir.stderr
    only = shell("gpu_check.sh", "--dry-run", "--only", "bf16,nope")
    assert only.returncode == 2 and "unknown check(s) ['nope']" in only.stderr
    chosen = shell("gpu_check.sh", "--dry-run", "--only", "hf-engine,bf16")
    assert [line.split()[0] for line in chosen.stdout.splitlines()] == ["hf-engine", "bf16"]


def test_python_entry_refuses_an_unknown_argument(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        gc.main(["--bogus"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def fake(monkeypatch, **fns) -> None:
    """CHECKS replaced by checks running ``fns`` (name -> function of the device)."""
    checks = []
    for name, fn in fns.items():
        monkeypatch.setattr(gpu_checks, f"fake_{name}", fn, raising=False)
        checks.append(gc.Check(name, "a fake", f"fake_{name}"))
    monkeypatch.setattr(gc, "CHECKS", tuple(checks))


def skip(device: str):
    raise gpu_checks.Skipped("no CUDA")


def boom(device: str):
    raise RuntimeError("kernel exploded\nsecond line")


def test_table_and_exit_status_from_fake_results(monkeypatch, capsys) -> None:
    fake(monkeypatch, a=lambda d: ("loss 1.0e-05", True), b=skip)
    assert gc.main([]) == 0  # a skip is not a failure
    fake(monkeypatch, a=lambda d: ("loss 1.0e-05", True), b=lambda d: ("grad cos 0.5", False))
    capsys.readouterr()
    assert gc.main([]) == 1
    *lines, summary = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"2 checks in \d+ s; failed: b", summary)
    rows = [re.split(r"\s{2,}", line) for line in lines]
    assert rows[0] == ["check", "figure", "result", "s"]
    assert [r[:3] for r in rows[2:]] == [
        ["a", "loss 1.0e-05", "pass"],
        ["b", "grad cos 0.5", "FAIL"],
    ]


def test_an_exception_is_a_failure_named_in_the_table(monkeypatch, capsys) -> None:
    fake(monkeypatch, ok=lambda d: ("fine", True), bad=boom, off=skip)
    assert gc.main(["--device", "cpu"]) == 1
    captured = capsys.readouterr()
    rows = [re.split(r"\s{2,}", line) for line in captured.out.splitlines()[2:-1]]
    assert [r[2] for r in rows] == ["pass", "FAIL", "skipped"]
    assert rows[1][1] == "error: RuntimeError: kernel exploded"  # one line in the table
    assert rows[2][1] == "skipped: no CUDA"
    assert "Traceback" in captured.err  # and the whole traceback on stderr


def test_table_columns_line_up() -> None:
    results = [gc.Result("a", "x", gc.PASS, 1.25), gc.Result("long-name", "figure", gc.FAIL, 0.0)]
    lines = gc.table(results).splitlines()
    assert len(lines) == 4 and set(lines[1]) <= {"-", " "}
    assert [line.index("result") for line in lines[:1]] == [lines[2].index("pass")]
    assert lines[3].split() == ["long-name", "figure", "FAIL", "0.0"]


@no_cuda
def test_without_cuda_the_cuda_check_fails_and_the_rest_skip(monkeypatch) -> None:
    # no compute: every check but `cuda` sees the absent GPU before it builds anything
    results = [gc.run_check(k, "cuda") for k in gc.CHECKS]
    assert results[0].status == gc.FAIL and "no CUDA device visible" in results[0].figure
    assert {r.name: r.figure for r in results[1:]} == dict.fromkeys(NAMES[1:], "skipped: no CUDA")
    assert gc.exit_code(results) == 1


@no_cuda
@pytest.mark.parametrize("name", NAMES)
def test_each_check_on_the_cpu_runs_or_skips(name: str) -> None:
    (check,) = gc.select(name)
    result = gc.run_check(check, "cpu")
    if name in CPU_RUNS:
        assert result.status == gc.PASS, result.figure
    else:
        assert result.status == gc.SKIP
        assert result.figure == ("skipped: device cpu" if name == "cuda" else "skipped: no CUDA")


def test_the_kernel_comparison_can_fail() -> None:
    """The tolerance catches a real difference: two different models are not one kernel."""
    a, b = gpu_checks.tiny_model(seed=0), gpu_checks.tiny_model(seed=1)
    rows = gpu_checks.grpo_rows()
    figure, ok = gpu_checks._kernel_pair("cpu", a, b, rows, rows, tight=True)
    assert not ok and figure.startswith("loss rel diff")


def test_flash_varlen_skips_without_flash_attn(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a)
    )
    with pytest.raises(gpu_checks.Skipped, match="flash-attn not installed"):
        gpu_checks.check_flash_varlen("cuda")


@pytest.mark.slow
def test_demo_run_reports_its_held_out_accuracy() -> None:
    """The demo check's run, on the CPU for 2 steps and 16 held-out problems."""
    figure, _ = gpu_checks.run_demo("cpu", 2, 1, "data.eval_limit=16")
    assert re.fullmatch(r"held-out \d\.\d{3} \(step 0\) -> \d\.\d{3} \(step 2\), \d+ s", figure)


def load_wheels_module():
    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheels_are_every_runtime_dependency_but_torch() -> None:
    wheels = load_wheels_module()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = {wheels.requirement_name(r) for r in project["project"]["dependencies"]}
    named = [wheels.requirement_name(r) for r in wheels.wheel_requirements()]
    assert "torch" in runtime and "torch" not in named
    assert set(named) == runtime - {"torch"} | {"setuptools"}  # setuptools builds rltool there
    assert {"omegaconf", "typer", "rich", "pydantic", "math-verify"} <= set(named)
    assert wheels.requirement_name("Math_Verify[x]>=0.8") == "math-verify"
    lean = [wheels.requirement_name(r) for r in wheels.wheel_requirements(lean=True)]
    assert set(lean) == set(named) - {"ray", "pyarrow"}


def test_wheels_script_arguments() -> None:
    assert shell("gpu_wheels.sh").returncode == 2
    bad = shell("gpu_wheels.sh", "DIR", "--mirror")
    assert bad.returncode == 2 and "unknown option '--mirror'" in bad.stderr
    two = shell("gpu_wheels.sh", "A", "B")
    assert two.returncode == 2 and "one directory only" in two.stderr
    printed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_wheels.py")], capture_output=True, text=True
    )
    assert printed.stdout.splitlines() == load_wheels_module().wheel_requirements()
    bad_py = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_wheels.py"), "--fat"], capture_output=True
    )
    assert bad_py.returncode != 0
