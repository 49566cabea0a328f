"""``python -m rltool.app.gpu_check``: the checks of the paths written for CUDA, one table.

``scripts/gpu_check.sh`` installs rltool on a bare GPU machine and runs this; docs/
distributed.md#gpu-check. Exit status: 0 when no check failed (a skipped check is not a
failure), 1 when one did, 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

CheckFn = Callable[[str], tuple[str, bool]]
CHECKS_MODULE = "rltool.app.gpu_checks"  # imported on a run only: --dry-run needs no torch
DEMO_STEPS = 20


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    what: str  # one line for --dry-run
    fn_name: str  # the function in gpu_checks: (device) -> (figure, ok)

    def fn(self) -> CheckFn:
        return getattr(importlib.import_module(CHECKS_MODULE), self.fn_name)


CHECKS: tuple[Check, ...] = (
    Check("cuda", "a CUDA device is visible to torch", "check_cuda"),
    Check("bf16", "model.dtype bfloat16 train step against fp32", "check_bf16"),
    Check(
        "flex-block",
        "shared-prefix rows, flex_attention BlockMask vs sdpa-tree",
        "check_flex_block",
    ),
    Check(
        "flash-varlen",
        "plain rows, flash-attn varlen vs sdpa-varlen (bf16; needs flash-attn)",
        "check_flash_varlen",
    ),
    Check(
        "activation-checkpointing",
        "non-reentrant gradient checkpointing vs none",
        "check_activation_checkpointing",
    ),
    Check(
        "fsdp2-nccl",
        "FSDP2 on a one-process NCCL group, bf16 mixed precision + checkpointing",
        "check_fsdp2_nccl",
    ),
    Check(
        "hf-engine",
        "HF engine generates on CUDA; trainer logprobs of its tokens match",
        "check_hf_engine",
    ),
    Check(
        "demo-20",
        f"rltool train recipes/gsm8k_tiny.yaml, {DEMO_STEPS} steps, held-out accuracy",
        "check_demo",
    ),
)
PASS, FAIL, SKIP = "pass", "FAIL", "skipped"


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    figure: str
    status: str  # pass | FAIL | skipped
    seconds: float


def run_check(check: Check, device: str) -> Result:
    """One check; an exception is a failure whose type and message are its figure (the
    traceback goes to stderr), ``Skipped`` a skip."""
    skipped = importlib.import_module(CHECKS_MODULE).Skipped
    start = time.monotonic()
    try:
        figure, ok = check.fn()(device)
        status = PASS if ok else FAIL
    except skipped as e:
        figure, status = f"skipped: {e}", SKIP
    except Exception as e:  # reported as the check's failure, with its traceback
        traceback.print_exc()
        figure, status = f"error: {type(e).__name__}: {e}".splitlines()[0], FAIL
    return Result(check.name, figure, status, time.monotonic() - start)


def table(results: Sequence[Result]) -> str:
    """One fixed-width text table (no terminal-width dependence)."""
    rows = [("check", "figure", "result", "s")]
    rows += [(r.name, r.figure, r.status, f"{r.seconds:.1f}") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def exit_code(results: Sequence[Result]) -> int:
    return 1 if any(r.status == FAIL for r in results) else 0


def select(names: str | None) -> list[Check]:
    if not names:
        return list(CHECKS)
    known = {k.name: k for k in CHECKS}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"--only: unknown check(s) {unknown}; known: {sorted(known)}")
    return [known[n] for n in wanted]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu_check", description="Run rltool's CUDA paths on this machine's GPU; one table."
    )
    p.add_argument("--dry-run", action="store_true", help="list the checks, run nothing")
    p.add_argument("--only", metavar="NAMES", help="comma-separated check names")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu: the CPU-safe checks")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)  # a bad argument: usage and exit 2
    try:
        checks = select(args.only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for k in checks:
            print(f"{k.name:<26} {k.what}")
        return 0
    results = []
    for k in checks:
        print(f"running {k.name} ...", file=sys.stderr, flush=True)
        results.append(run_check(k, args.device))
    print(table(results))
    failed = [r.name for r in results if r.status == FAIL]
    took = sum(r.seconds for r in results)
    print(f"{len(results)} checks in {took:.0f} s; failed: {', '.join(failed) or 'none'}")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
