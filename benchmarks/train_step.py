"""The demo's train step (``time/train``), eager before and after the branch-query attention
of shared rows, and with compiled decoder layers (``trainer.compile: layers``), timed on
the same packs in one run. The tiny GSM8K recipe generates ``--capture`` steps and keeps
each step's packs; every variant then trains its own copy of the demo model (its own
AdamW) on those packs, ``--rounds`` times, the variants interleaved step by step (in
turning order), so that load on the machine falls on all of them alike. Run from the
repository root::

    PYTHONPATH=. python benchmarks/train_step.py                  # 2 threads, as vs_trl.py
    PYTHONPATH=. python benchmarks/train_step.py --compile --threads 1

Prints each variant's seconds per step (the first round, which holds the compile, apart)
and its ratio to ``before``, and how far the variants' weights end apart. Figures:
docs/foundations.md (Where a train step's time goes).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

from rltool.app.driver import train
from rltool.app.run import build_updater
from rltool.config.loader import load_recipe
from rltool.models import load_model_and_tokenizer
from rltool.report.train_view import TrainView
from rltool.training import attention, updater
from rltool.training.batch import Pack

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gsm8k_tiny.yaml"


def capture(steps: int, threads: int) -> list[list[Pack]]:
    """The packs of the demo's first ``steps`` train steps."""
    got: list[list[Pack]] = []
    step = updater.PolicyUpdater.step

    def keep(self, packs):
        got.append(list(packs))
        return step(self, packs)

    updater.PolicyUpdater.step = keep
    try:
        with tempfile.TemporaryDirectory(prefix="train-step-") as tmp:
            overrides = [f"trainer.steps={steps}", "trainer.time_budget_s=null",
                         "trainer.eval_every=0", "data.eval_limit=1",
                         f"trainer.threads={threads}", f"logging.run_dir={tmp}"]  # fmt: skip
            train(load_recipe(RECIPE, overrides), view=TrainView(quiet=True))
    finally:
        updater.PolicyUpdater.step = step
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capture", type=int, default=3, help="demo steps whose packs are kept")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the kept steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="add trainer.compile: layers")
    args = ap.parse_args()
    if args.rounds < 2:
        raise ValueError("need --rounds >= 2: the first round warms up (and compiles)")
    steps = capture(args.capture, args.threads)
    torch.set_num_threads(args.threads)
    recipe = load_recipe(RECIPE, [])
    model, _, _ = load_model_and_tokenizer(recipe.model)
    budget = attention.MASK_BUDGET
    # before: branch pieces causal over prefix + branch (MASK_BUDGET 0); now: branch queries
    variants = {"before": (0, "off"), "now": (budget, "off")}
    if args.compile:
        variants["compiled"] = (budget, "layers")
    models = {name: copy.deepcopy(model) for name in variants}
    updaters = {}
    for name, (_, mode) in variants.items():
        recipe.trainer.compile = mode
        updaters[name] = build_updater(recipe, models[name])
    first = dict.fromkeys(variants, 0.0)
    rest = dict.fromkeys(variants, 0.0)
    turn = 0
    for r in range(args.rounds):
        for packs in steps:
            names = list(variants)
            names = names[turn % len(names) :] + names[: turn % len(names)]
            turn += 1
            for name in names:
                attention.MASK_BUDGET = variants[name][0]
                t0 = time.perf_counter()
                updaters[name].step(packs)
                (first if r == 0 else rest)[name] += time.perf_counter() - t0
    attention.MASK_BUDGET = budget
    n = len(steps) * (args.rounds - 1)
    tokens = sum(len(p) for packs in steps for p in packs) / len(steps)
    per_step = sum(map(len, steps)) / len(steps)
    print(f"\n{args.threads} thread(s), {len(steps)} demo steps x {args.rounds} rounds, "
          f"{tokens:.0f} tokens in {per_step:.1f} packs per step")  # fmt: skip
    print(f"{'variant':10}{'first round s':>15}{'s/step after':>14}{'vs before':>11}")
    for name in variants:
        ratio = rest["before"] / rest[name]
        print(f"{name:10}{first[name]:15.2f}{rest[name] / n:14.3f}{ratio:10.3f}x")
    ref = dict(models["before"].named_parameters())
    for name in list(variants)[1:]:
        diff = max((p - ref[k]).abs().max().item() for k, p in models[name].named_parameters())
        print(f"max |weight - before's| after {len(steps) * args.rounds} steps, {name}: {diff:.2e}")


if __name__ == "__main__":
    main()
