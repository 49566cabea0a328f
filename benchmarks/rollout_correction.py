"""The rollout correction's cost as a share of a demo train step (docs/losses.md).

    python benchmarks/rollout_correction.py                  # seq_mis, 5 repeats
    python benchmarks/rollout_correction.py --preset icepop --repeats 3

A demo-sized step: 32 prompts x 8 samples of 29 prompt and 13-40 response tokens, converted
by ``convert_groups`` with the demo recipe's settings, trained by ``PolicyUpdater.step`` on
the demo model (built on first use). The correction's share is the time of everything it
adds to a step (``correct_row`` on every row and ``mismatch_metrics`` over the step), timed
on the same rows, over the median ``PolicyUpdater.step`` time: both are measured in the same
process, alternately, so a loaded machine slows both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from rltool.app.demo_model import ensure_builtin_models
from rltool.app.run import build_updater
from rltool.config.correction import resolve_correction
from rltool.config.loader import load_recipe
from rltool.models import load_model_and_tokenizer
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status
from rltool.training.convert import ConversionConfig, convert_groups
from rltool.training.logprobs import forward_logprobs
from rltool.training.rollout_correction import correct_row, mismatch_metrics


def demo_groups(vocab: int, seed: int = 0) -> list[list[RolloutState]]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(32):
        prompt = rng.integers(3, vocab, 29).tolist()
        members = []
        for k in range(8):
            response = rng.integers(3, vocab, int(rng.integers(13, 41))).tolist()
            ids = prompt + response
            lp = [0.0] * len(prompt) + (-rng.random(len(response)) * 2).tolist()
            members.append(
                RolloutState(
                    rollout_id=f"{g}-{k}",
                    group_id=str(g),
                    task_name="gsm8k",
                    prompt_ids=prompt,
                    response_ids=response,
                    input_ids=ids,
                    labels=[IGNORE_INDEX] * len(prompt) + response,
                    logprobs=lp,
                    reward={"score": float(rng.integers(0, 2))},
                    status=Status.COMPLETED,
                )
            )
        groups.append(members)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="seq_mis")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    recipe = load_recipe("recipes/gsm8k_tiny.yaml", [f"algorithm.rollout_correction={args.preset}"])
    ensure_builtin_models(recipe.model.path, None)
    model, tokenizer, _ = load_model_and_tokenizer(recipe.model)
    packs = convert_groups(demo_groups(len(tokenizer)), ConversionConfig.from_recipe(recipe)).packs
    updater = build_updater(recipe, model)
    spec = resolve_correction(recipe.algorithm)
    steps, corrections = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        updater.step(packs)
        steps.append(time.perf_counter() - t0)
        with torch.no_grad():
            olds = [forward_logprobs(model, p, 1.0, False)[0] for p in packs]
        t0 = time.perf_counter()
        rows = [
            correct_row(
                old,
                p.rollout_logprobs,
                p.targets != IGNORE_INDEX,
                p.has_rollout_logprobs,
                p.cu_seq_lens,
                spec,
            )
            for old, p in zip(olds, packs, strict=True)
        ]
        mismatch_metrics(rows, spec)
        corrections.append(time.perf_counter() - t0)
    step, corr = statistics.median(steps), statistics.median(corrections)
    tokens = sum(len(p) for p in packs)
    print(
        f"{args.preset}: {len(packs)} rows, {tokens} tokens; train step {step:.3f} s, "
        f"correction {corr * 1000:.1f} ms = {100 * corr / step:.2f}% of the step "
        f"(medians of {args.repeats})"
    )


if __name__ == "__main__":
    main()
