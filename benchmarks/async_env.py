"""Sync vs async production where rollouts wait on an environment: the OpenEnv guess-number
recipe (recipes/openenv_guess.yaml) with every environment step delayed, trained for the same
wall-clock budget each way; steps per second and held-out score side by side (async / sync).

Each episode's steps wait ``--latency-s`` (the game server sleeps, as a remote game or
sandbox would): in sync mode the trainer waits for them; in async mode the next step's
episodes play while the trainer trains, so the waiting overlaps training. Run from the
repository root in the environment that has openenv-core (bash scripts/envs_env.sh)::

    PYTHONPATH=. .venv-envs/bin/python benchmarks/async_env.py               # 200 ms a step
    PYTHONPATH=. .venv-envs/bin/python benchmarks/async_env.py --latency-s 0.1 --budget-s 300

Both runs share the recipe, seed and budget; the held-out score is the greedy evaluation on
the same eval rows after each run. On a shared machine timings are noisy: the script prints
``uptime`` before and after; compare the ratios of one invocation.

The last run (2026-12-03, defaults: 200 ms a step, 120 s a mode, 50 held-out episodes; 2
cores shared with other jobs, load average 3.0 at the start, 3.6 at the end): sync 5 steps,
0.034 steps/s; async 8 steps, 0.057 steps/s (1.69x); held-out score 0.000 sync, 0.160
async (0.200 before either trained); env step 0.21-0.22 s both. The train step varied with
the load (26 s sync, 13 s async, excluding step 1) and dominates; the async run overlaps
its generation (5 s) and the environment's waits with it. An earlier, shorter run under
load 6-11 (90 s a mode) gave 1.49x.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from rltool.app.driver import train
from rltool.config.loader import load_recipe
from rltool.report.train_view import TrainView

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "openenv_guess.yaml"
# asynchronous production as recipes/gsm8k_tiny_async.yaml sets it, on a generator thread
ASYNC = [
    "produce.mode=async",
    "produce.max_inflight_steps=1",
    "rollout.chunk_tokens=6",
    "algorithm.sync_interval=1",
    "algorithm.max_token_staleness=1",
    "algorithm.max_staleness=2",
]


def run_mode(mode: str, args: argparse.Namespace, run_dir: Path) -> dict[str, float]:
    overrides = [
        f"agent_loop.options.server_env.GUESS_NUMBER_STEP_LATENCY_S={args.latency_s}",
        f"trainer.time_budget_s={args.budget_s}",
        f"trainer.steps={args.max_steps}",
        "trainer.eval_every=0",
        f"data.eval_limit={args.eval_limit}",
        f"trainer.seed={args.seed}",
        f"logging.run_dir={run_dir}",
        f"logging.name={mode}",
        *([*ASYNC, f"rollout.backend={args.backend}"] if mode == "async" else []),
    ]
    recipe = load_recipe(RECIPE, overrides)
    torch.set_num_threads(args.threads)
    print(f"[{mode}] training for {args.budget_s:.0f} s ...", flush=True)
    outcome = train(recipe, view=TrainView(quiet=True))
    history = [
        h
        for h in map(json.loads, (outcome.run_dir / "metrics.jsonl").read_text().splitlines())
        if h["kind"] == "train"
    ]
    later = history[1:] or history  # step 1 includes warm-up (and no overlap in async)
    wall = float(np.sum([h["time/step"] for h in history]))
    return {
        "steps": float(outcome.steps_done),
        "steps/s": outcome.steps_done / wall if wall > 0 else math.nan,
        "s/step": float(np.mean([h["time/step"] for h in later])),
        "generate s/step": float(np.mean([h["time/generate"] for h in later])),
        "train s/step": float(np.mean([h["time/train"] for h in later])),
        "overlap s/step": float(np.mean([h.get("time/overlap", 0.0) for h in later])),
        "env step s (mean)": float(np.mean([h.get("openenv/step_s_mean", 0.0) for h in later])),
        "reward (last steps)": float(
            np.mean([h["rollout/reward_mean"] for h in history[-args.reward_window :]])
        ),
        "held-out score": outcome.last_eval.get("eval/accuracy", math.nan),
    }


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency-s", type=float, default=0.2, help="wait of each env step")
    ap.add_argument("--budget-s", type=float, default=120.0, help="training seconds per mode")
    ap.add_argument("--max-steps", type=int, default=1000, help="hard cap on steps per mode")
    ap.add_argument("--eval-limit", type=int, default=50, help="held-out episodes at the end")
    ap.add_argument("--reward-window", type=int, default=5, help="last steps the reward averages")
    ap.add_argument("--backend", default="inprocess", choices=("inprocess", "ray"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the sync run"
    )
    args = ap.parse_args()
    if args.budget_s <= 0 or args.max_steps < 1 or args.reward_window < 1 or args.latency_s < 0:
        raise ValueError(
            "need --budget-s > 0, --max-steps >= 1, --reward-window >= 1, --latency-s >= 0"
        )
    os.chdir(ROOT)  # the recipe's app_dir is relative to the repository root
    before = uptime()
    with tempfile.TemporaryDirectory(prefix="async-env-bench-") as tmp:
        results = {mode: run_mode(mode, args, Path(tmp)) for mode in ("sync", "async")}
    print(f"\nlatency {args.latency_s:g} s per env step, budget {args.budget_s:g} s per mode")
    print(f"uptime before: {before}\nuptime after:  {uptime()}")
    sync, asyn = results["sync"], results["async"]
    print(f"\n{'':26}{'sync':>10}{'async':>10}{'async/sync':>12}")
    for key in sync:
        a, s = asyn[key], sync[key]
        ratio = a / s if s and not math.isnan(s) and not math.isnan(a) else math.nan
        print(f"{key:26}{s:10.3f}{a:10.3f}{ratio:12.2f}")


if __name__ == "__main__":
    main()
