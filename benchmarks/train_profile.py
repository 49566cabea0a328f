"""Where one demo train step's time goes (``time/train``): the tiny GSM8K recipe runs a few
steps and its last one runs under the torch profiler, with the conversion (packing), each
pack's forward, loss, backward and the optimizer step labelled; prints their totals and the
ops that took the most time. Run from the repository root::

    PYTHONPATH=. python benchmarks/train_profile.py                # 3 steps, 1 thread
    PYTHONPATH=. python benchmarks/train_profile.py --threads 2 --steps 4

The profiler adds a few percent to the step. Figures and what they mean: docs/foundations.md
(Where a train step's time goes).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from rltool.app.driver import train
from rltool.config.loader import load_recipe
from rltool.report.train_view import TrainView
from rltool.training import controller, updater

ROOT = Path(__file__).resolve().parents[1]
# (owner, attribute) wrapped in a profiler label while the profiled step runs
SECTIONS = [
    (controller, "convert_groups"),  # validation, advantages, packing
    (updater, "forward_logprobs_distill"),  # a pack's forward and logprobs
    (updater.PolicyUpdater, "_micro_loss"),  # the forward above plus the loss
    (updater.PolicyUpdater, "_logprobs_no_grad"),  # old / reference logprobs, when needed
    (torch.Tensor, "backward"),
    (updater.PolicyUpdater, "_optimizer_step"),  # clip, step, zero
]


def labelled(fn: Callable, name: str) -> Callable:
    def run(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="the last one is profiled")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=20, help="ops listed")
    args = ap.parse_args()
    if args.steps < 2:
        raise ValueError("need --steps >= 2: the first step warms up")
    fit, seen, got = controller.TrainingController.fit, [0], {}

    def profiled_fit(self, groups, train_step):
        seen[0] += 1
        if seen[0] != args.steps:
            return fit(self, groups, train_step)
        saved = [(owner, name, getattr(owner, name)) for owner, name in SECTIONS]
        for owner, name, fn in saved:
            setattr(owner, name, labelled(fn, f"[{name}]"))
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                out = fit(self, groups, train_step)
                got["wall"] = time.perf_counter() - t0
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)
        got["prof"], got["metrics"] = prof, out.metrics
        return out

    controller.TrainingController.fit = profiled_fit
    with tempfile.TemporaryDirectory(prefix="train-profile-") as tmp:
        recipe = load_recipe(
            ROOT / "recipes" / "gsm8k_tiny.yaml",
            [
                f"trainer.steps={args.steps}",
                "trainer.time_budget_s=null",
                "trainer.eval_every=0",
                "data.eval_limit=1",
                f"trainer.threads={args.threads}",
                f"logging.run_dir={tmp}",
            ],
        )
        train(recipe, view=TrainView(quiet=True))
    controller.TrainingController.fit = fit
    prof, m = got["prof"], got["metrics"]
    print(f"\nstep {args.steps}, {args.threads} thread(s): {got['wall']:.3f} s under the profiler")
    keys = ["data/packs", "data/training_tokens", "data/supervised_tokens"]
    print(", ".join(f"{k} {m[k]:.0f}" for k in keys))
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    for e in sorted(events, key=lambda e: -e.cpu_time_total):
        if e.key.startswith("["):
            share = e.cpu_time_total / total
            print(f"{e.key:30}{e.count:6d} calls{e.cpu_time_total / 1e6:9.3f} s{share:8.1%}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
