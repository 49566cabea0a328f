"""LoRA generation against the full model's: ``recipes/gsm8k_tiny_lora.yaml`` and
``recipes/gsm8k_tiny.yaml`` built in one process with the same seed and stepped in turn
(generate, train, sync), so both see the same machine load; each run keeps its own random
streams. Prints, per step, each run's generate time (wall and process CPU seconds), its
sync time, and the ratio LoRA / full of the median of steps 2..N. Run from the repository
root::

    PYTHONPATH=. python benchmarks/lora_generate.py              # 4 steps
    PYTHONPATH=. python benchmarks/lora_generate.py --steps 6 --threads 1

Figures and what they mean: docs/lora.md (Generation speed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rltool.app.run import build_run, generate_step
from rltool.config.loader import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"full": "recipes/gsm8k_tiny.yaml", "lora": "recipes/gsm8k_tiny_lora.yaml"}


def _timed(fn):
    """(result, wall s, process CPU s) of ``fn()``."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--threads", type=int, default=None, help="trainer.threads (default: the recipe's)"
    )
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="lora_generate_")
    runs, rng = {}, {}
    for name, recipe in RECIPES.items():
        overrides = [f"logging.run_dir={tmp}/{name}", "trainer.eval_every=0"]
        if args.threads is not None:
            overrides.append(f"trainer.threads={args.threads}")
        runs[name] = build_run(load_recipe(str(ROOT / recipe), overrides))
        rng[name] = torch.get_rng_state()  # build_run seeded it: each run's own stream
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    try:
        for step in range(1, args.steps + 1):
            for name, run in runs.items():
                torch.set_rng_state(rng[name])
                groups, wall, cpu = _timed(lambda run=run: generate_step(run))
                run.controller.fit(groups, train_step=step)
                run.step = step
                _, sync, _ = _timed(
                    lambda run=run: run.producer.update_weights(run.model, run.step)
                )
                rng[name] = torch.get_rng_state()
                rows[name].append((wall, cpu, sync))
                print(
                    f"step {step} {name:4s} generate {wall:6.2f} s wall {cpu:6.2f} s CPU, "
                    f"sync {sync:.3f} s"
                )
    finally:
        for run in runs.values():
            run.close()
    later = {name: r[1:] or r for name, r in rows.items()}  # step 1 warms up
    for i, label in ((0, "wall"), (1, "CPU")):
        med = {name: statistics.median(x[i] for x in r) for name, r in later.items()}
        print(
            f"median generate, steps 2-{args.steps} ({label}): full {med['full']:.2f} s, "
            f"lora {med['lora']:.2f} s, ratio {med['lora'] / med['full']:.2f}"
        )
    print("load average (1, 5, 15 min) at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
