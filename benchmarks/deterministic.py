"""The cost of ``trainer.deterministic: true``: the tiny GSM8K recipe trained a few steps with
it off and on, alternately (off, on, off, on, ...) in one process so that a shared
machine's load falls on both alike; median seconds per step (generate, train, whole step)
side by side with the ratio (on / off).

What it costs: deterministic kernels (``torch.use_deterministic_algorithms``; on the CPU
mostly the default ones) and per-sample sampling streams in the HF engine
(engines/hf_sampling.py: one uniform per row from its own generator, then an inverse-CDF
search, instead of one batched multinomial). Run from the repository root::

    PYTHONPATH=. python benchmarks/deterministic.py               # 3 rounds of 4 steps
    PYTHONPATH=. python benchmarks/deterministic.py --rounds 5 --steps 6

Step 1 of each run (warm-up) is left out; the thread count is fixed (``--threads``) in
both modes, as a deterministic run should fix it. The per-run step times are printed so
that a round hit by another job's load can be told apart.

Last run (2026-12-03, defaults, 2 shared cores, load 0.9 at the start, 2.8 at the end):
median s/step off 4.253, on 3.926 (on/off 0.92); generate 1.669 vs 1.592, train 2.589 vs
2.371. The unloaded rounds: off 4.05-4.32 s a step, on 3.87-4.06 s; no cost measurable.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from rltool.app.driver import train
from rltool.config.loader import load_recipe
from rltool.report.train_view import TrainView

ROOT = Path(__file__).resolve().parents[1]
FIGURES = {"generate s/step": "time/generate", "train s/step": "time/train", "s/step": "time/step"}


def run_once(deterministic: bool, args: argparse.Namespace, run_dir: Path) -> list[dict]:
    recipe = load_recipe(
        ROOT / "recipes" / "gsm8k_tiny.yaml",
        [
            f"trainer.steps={args.steps}",
            "trainer.time_budget_s=null",
            "trainer.eval_every=0",
            "data.eval_limit=1",
            f"trainer.deterministic={str(deterministic).lower()}",
            f"trainer.threads={args.threads}",
            f"logging.run_dir={run_dir}",
            f"logging.name={'on' if deterministic else 'off'}",
        ],
    )
    outcome = train(recipe, view=TrainView(quiet=True))
    torch.use_deterministic_algorithms(False)  # the switch is process-wide: back off
    lines = (outcome.run_dir / "metrics.jsonl").read_text().splitlines()
    return [h for h in map(json.loads, lines) if h["kind"] == "train"][1:]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="off/on pairs")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in both modes")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 2 or args.threads < 1:
        raise ValueError("need --rounds >= 1, --steps >= 2 and --threads >= 1")
    before = uptime()
    lines: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="determinism-bench-") as tmp:
        for r in range(args.rounds):
            for on in (False, True):
                print(f"round {r + 1}/{args.rounds}, deterministic {on} ...", flush=True)
                got = run_once(on, args, Path(tmp) / f"r{r}")
                lines[on] += got
                steps = ", ".join(f"{h['time/step']:.2f}" for h in got)
                print(
                    f"  s/step: {steps}; response length {got[-1]['rollout/response_len/mean']:.1f}"
                )
    print(f"\nuptime before: {before}\nuptime after:  {uptime()}")
    print(f"{args.rounds} runs a mode, {args.steps - 1} steps each counted, {args.threads} threads")
    print(f"\n{'median':18}{'off':>10}{'on':>10}{'on/off':>10}")
    for label, key in FIGURES.items():
        off = float(np.median([h[key] for h in lines[False]]))
        on = float(np.median([h[key] for h in lines[True]]))
        print(f"{label:18}{off:10.3f}{on:10.3f}{on / off:10.2f}")


if __name__ == "__main__":
    main()
