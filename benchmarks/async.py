"""Sync vs async production on the tiny GSM8K recipe: wall-clock per step and reward after a
fixed training-time budget, side by side with ratios (async / sync).

Both runs train the built-in demo model with the same recipe, seed and budget; the async
run generates the next step's groups while the trainer trains (``produce.mode: async``,
chunked generation, weights synced every step). Defaults take about 2-4 minutes on
2 CPU cores, the demo model's one-off build (~40 s) included::

    PYTHONPATH=. python benchmarks/async.py          # in-process generator thread
    python benchmarks/async.py --backend ray         # a Ray rollout worker
    python benchmarks/async.py --budget-s 120 --eval-limit 200

On a shared machine timings are noisy: compare the ratios of one invocation.
On a CPU, both sides compete for the same cores: measured on 2 idle cores, sync
(2 threads) took 3.9 s/step and async (1 + 1 threads, Ray) 5.5-6.8 s/step, its
generation alone on one core being the bottleneck. Async pays where generation
and training run on separate devices, or where rollouts wait on environments.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from rltool.app.driver import train
from rltool.config.loader import load_recipe
from rltool.report.train_view import TrainView

ROOT = Path(__file__).resolve().parents[1]


def run_mode(mode: str, args: argparse.Namespace, run_dir: Path) -> dict[str, float]:
    recipe_file = "gsm8k_tiny_async.yaml" if mode == "async" else "gsm8k_tiny.yaml"
    overrides = [
        f"trainer.time_budget_s={args.budget_s}",
        f"trainer.steps={args.max_steps}",
        "trainer.eval_every=0",
        f"data.eval_limit={args.eval_limit}",
        f"trainer.seed={args.seed}",
        f"logging.run_dir={run_dir}",
        f"logging.name={mode}",
    ]
    if mode == "async":
        overrides.append(f"rollout.backend={args.backend}")
    recipe = load_recipe(ROOT / "recipes" / recipe_file, overrides)
    # sync uses every core in both phases (what `rltool train` does); async gives each of
    # its two sides (trainer, rollout worker) half of them
    torch.set_num_threads(args.threads)
    print(f"[{mode}] training for {args.budget_s:.0f} s ...", flush=True)
    outcome = train(recipe, view=TrainView(quiet=True))
    history = outcome_history(outcome.run_dir)
    later = history[1:] or history  # step 1 includes warm-up (and no overlap in async)
    rewards = [
        h["rollout/reward_mean"] for h in history if not math.isnan(h["rollout/reward_mean"])
    ]
    tail = rewards[-args.reward_window :]
    return {
        "steps": float(outcome.steps_done),
        "s/step": float(np.mean([h["time/step"] for h in later])),
        "generate s/step": float(np.mean([h["time/generate"] for h in later])),
        "train s/step": float(np.mean([h["time/train"] for h in later])),
        "overlap s/step": float(np.mean([h.get("time/overlap", 0.0) for h in later])),
        f"reward (last {args.reward_window})": float(np.mean(tail)) if tail else math.nan,
        "held-out accuracy": outcome.last_eval.get("eval/accuracy", math.nan),
    }


def outcome_history(run_dir: Path) -> list[dict[str, float]]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [x for x in map(json.loads, lines) if x["kind"] == "train"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=60.0, help="training seconds per mode")
    ap.add_argument("--max-steps", type=int, default=1000, help="hard cap on steps per mode")
    ap.add_argument("--eval-limit", type=int, default=100, help="held-out problems at the end")
    ap.add_argument("--reward-window", type=int, default=5, help="last steps the reward averages")
    ap.add_argument("--backend", default="inprocess", choices=("inprocess", "ray"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the sync run"
    )
    args = ap.parse_args()
    if args.budget_s <= 0 or args.max_steps < 1 or args.reward_window < 1:
        raise ValueError("need --budget-s > 0, --max-steps >= 1 and --reward-window >= 1")
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        results = {mode: run_mode(mode, args, Path(tmp)) for mode in ("sync", "async")}
    sync, asyn = results["sync"], results["async"]
    print(f"\n{'':26}{'sync':>10}{'async':>10}{'async/sync':>12}")
    for key in sync:
        a, s = asyn[key], sync[key]
        ratio = a / s if s and not math.isnan(s) and not math.isnan(a) else math.nan
        print(f"{key:26}{s:10.3f}{a:10.3f}{ratio:12.2f}")


if __name__ == "__main__":
    main()
