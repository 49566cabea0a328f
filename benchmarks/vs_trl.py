"""rltool against TRL's ``GRPOTrainer`` on the demo model: seconds per step and accuracy.

Both trainers start from a fresh copy of the same warm checkpoint
(``builtin:tiny-gsm8k``, its SFT optimizer state left out) and run GRPO with
matched settings: the same 32 prompts per step in the same order (rltool's
``PromptSampler``), 8 samples each, temperature 1.0, ``max_new_tokens`` of the
recipe, AdamW at a constant 3e-4 with no warmup, grad clip 1.0, no KL,
clip 0.2, token-mean loss (TRL ``loss_type="dapo"``), one update per batch,
the same seed and thread count.

- Seconds per step, paired: ``--steps`` steps of each trainer taken in turn (an
  rltool step after each TRL step, each on its own fresh checkpoint), so that a
  slower or faster spell of the machine falls on both. This is the ratio to quote:
  the budget runs below take minutes each, one after the other, and on these VMs
  the same code has measured from 2.2x to 3.7x there within an hour.
- Accuracy: each trainer alone trains until ``--budget-s`` seconds of training are
  spent (setup and evaluation excluded); their first ``--steps`` steps are printed
  too. Held-out greedy accuracy is measured identically for both: rltool's GSM8K
  loop ``evaluate`` on an ``HFEngine`` over the trained model, on the recipe's first
  ``eval_limit`` test problems.

TRL is a benchmark-only extra (``pip install -e '.[bench]'``)::

    python benchmarks/vs_trl.py                       # 10 paired steps, 120 s budgets
    python benchmarks/vs_trl.py --steps 3 --budget-s 60
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rltool.agent_loops.gsm8k import ground_truth_of
from rltool.app.demo_model import OPTIMIZER_FILE, ensure_demo_checkpoint
from rltool.app.run import build_run, evaluate, generate_step
from rltool.config.loader import load_recipe
from rltool.config.schema import RecipeConfig
from rltool.engines.hf import HFEngine
from rltool.produce.result import rollout_metrics
from rltool.produce.sampler import PromptSampler
from rltool.produce.task_loops import build_task_loops
from rltool.rewards.gsm8k import gsm8k_reward

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "gsm8k_tiny.yaml"


@dataclass
class Result:
    name: str
    step_s: list[float]  # wall time of each training step (generation + update)
    train_s: float  # training time spent in the budget run
    eval: dict[str, float]

    def s_per_step(self, n: int) -> float:
        return statistics.mean(self.step_s[:n])


def fresh_checkpoint(src: Path, root: Path, name: str) -> Path:
    """A private copy of the warm checkpoint without its SFT optimizer moments:
    TRL cannot load them, so both trainers start from a fresh AdamW."""
    dst = root / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(OPTIMIZER_FILE))
    return dst


def matched_recipe(model_dir: Path, seed: int) -> RecipeConfig:
    return load_recipe(
        RECIPE,
        [
            f"model.path={model_dir}",
            "model.device=cpu",
            "optimizer.warmup_steps=0",  # TRL runs constant, no warmup
            "optimizer.schedule=constant",
            "optimizer.init_from_checkpoint=false",
            "algorithm.kl_coef=0.0",
            f"trainer.seed={seed}",
        ],
    )


def eval_model(recipe: RecipeConfig, model: Any, tokenizer: Any, tasks: list[dict]) -> dict:
    """rltool's greedy held-out evaluation, applied to any model object."""
    engine = HFEngine(model, tokenizer, batch_size=recipe.rollout.batch_size)
    model.eval()
    (loop,) = build_task_loops(recipe, engine, tokenizer).values()
    out = loop.evaluate(tasks, recipe.rollout.eval_sampling)
    model.train()
    return out


# --- rltool -----------------------------------------------------------------------------


def rltool_step(run: Any) -> float:
    """One rltool step (generate, train, hand the weights over); its wall seconds."""
    t0 = time.perf_counter()
    groups = generate_step(run)
    t_gen = time.perf_counter() - t0
    run.controller.fit(groups, train_step=run.step + 1)
    run.step += 1
    run.producer.update_weights(run.model, run.step)
    took = time.perf_counter() - t0
    m = rollout_metrics(groups)
    print(
        f"  rltool step {run.step:3d}  {took:5.2f} s (generate {t_gen:.2f})  "
        f"reward {m['rollout/reward_mean']:.3f}  "
        f"len {m['rollout/response_len/mean']:.1f}  "
        f"truncated {m['rollout/truncated_frac']:.2f}",
        flush=True,
    )
    return took


def run_rltool(model_dir: Path, seed: int, budget_s: float, max_steps: int) -> Result:
    run = build_run(matched_recipe(model_dir, seed))
    step_s: list[float] = []
    t_start = time.perf_counter()
    while run.step < max_steps:
        step_s.append(rltool_step(run))
        if time.perf_counter() - t_start >= budget_s:
            break
    train_s = time.perf_counter() - t_start
    return Result("rltool", step_s, train_s, evaluate(run))


# --- TRL --------------------------------------------------------------------------------


def trl_dataset(recipe: RecipeConfig, tasks: list[dict], max_steps: int):
    """Rows in rltool's prompt order, so that step k of both sees the same prompts."""
    from datasets import Dataset

    sampler = PromptSampler(len(tasks), recipe.trainer.seed, recipe.data.shuffle)
    order = sampler.take(max_steps * recipe.data.prompts_per_step)
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": str(tasks[i]["question"])}],
                "ground_truth": ground_truth_of(tasks[i]),
            }
            for i in order
        ]
    )


def gsm8k_reward_func(completions: list, ground_truth: list[str], **_: Any) -> list[float | None]:
    # None (reward could not be computed) is NaN to TRL: left out of the mean, as rltool does.
    return [
        gsm8k_reward(c[0]["content"], gt).score
        for c, gt in zip(completions, ground_truth, strict=True)
    ]


def trl_timer(budget_s: float, step_s: list[float], between: Callable[[], Any] | None = None):
    from transformers import TrainerCallback

    class BudgetTimer(TrainerCallback):
        """Times each optimizer step (end to end) and stops once the budget is spent;
        ``between`` runs after each step, outside the step's time and the budget."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.t_start = self.t_last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            step_s.append(now - self.t_last)
            if now - self.t_start >= budget_s:
                control.should_training_stop = True
            if between is not None:
                between()
                self.t_start += time.perf_counter() - now
            self.t_last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                print(
                    f"  trl    step {state.global_step:3d}  {step_s[-1]:5.2f} s  "
                    f"reward {logs['reward']:.3f}  "
                    f"len {logs.get('completions/mean_length', 0):.1f}  "
                    f"truncated {logs.get('completions/clipped_ratio', 0):.2f}",
                    flush=True,
                )

    return BudgetTimer()


def run_trl(
    model_dir: Path,
    seed: int,
    budget_s: float,
    max_steps: int,
    out_dir: Path,
    between: Callable[[], Any] | None = None,
) -> Result:
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    recipe = matched_recipe(model_dir, seed)
    train_tasks, eval_tasks = _tasks(recipe)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    d, s, o = recipe.data, recipe.rollout.sampling, recipe.optimizer
    n_completions = d.prompts_per_step * d.group_size
    config = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=seed,
        max_steps=max_steps,
        per_device_train_batch_size=n_completions,  # one optimizer step = 32 prompts x 8
        gradient_accumulation_steps=1,
        generation_batch_size=n_completions,
        num_generations=d.group_size,
        num_iterations=1,
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        learning_rate=o.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_epsilon=o.eps,
        max_grad_norm=o.grad_clip,
        beta=0.0,
        epsilon=recipe.algorithm.clip_low,
        epsilon_high=recipe.algorithm.clip_high,
        loss_type="dapo",  # token-mean over the whole batch, like rltool's token-mean
        scale_rewards="group",  # (r - mean) / std within the group, like rltool's grpo
        shuffle_dataset=False,  # the dataset is already in rltool's order
        gradient_checkpointing=False,  # on by default in GRPOConfig; rltool recomputes nothing
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    step_s: list[float] = []
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=gsm8k_reward_func,
        args=config,
        train_dataset=trl_dataset(recipe, train_tasks, max_steps),
        processing_class=tokenizer,
        callbacks=[trl_timer(budget_s, step_s, between)],
    )
    trainer.remove_callback(PrinterCallback)  # our timer prints a compact line per step
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    if between is not None:  # the paired phase: timings only
        return Result("trl", step_s, train_s, {})
    return Result("trl", step_s, train_s, eval_model(recipe, trainer.model, tokenizer, eval_tasks))


def run_paired(src: Path, root: Path, seed: int, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` TRL and rltool steps taken in turn (one rltool step after each TRL step,
    each trainer on its own fresh checkpoint): a slower or faster spell of the machine
    falls on both, where the budget runs take minutes each, one after the other. Seconds
    per step of (rltool, TRL)."""
    run = build_run(matched_recipe(fresh_checkpoint(src, root, "paired-rltool"), seed))
    ours: list[float] = []
    trl = run_trl(
        fresh_checkpoint(src, root, "paired-trl"),
        seed,
        float("inf"),
        steps,
        root / "paired_trl_out",
        between=lambda: ours.append(rltool_step(run)),
    )
    return ours, trl.step_s


def _tasks(recipe: RecipeConfig) -> tuple[list[dict], list[dict]]:
    from rltool.builtin import resolve_builtin_data
    from rltool.data import load_examples

    train = load_examples([resolve_builtin_data(f) for f in recipe.data.train_files])
    test = load_examples([resolve_builtin_data(f) for f in recipe.data.eval_files])
    return train, test[: recipe.data.eval_limit] if recipe.data.eval_limit else test


# --- main -------------------------------------------------------------------------------


def initial_accuracy(model_dir: Path, seed: int) -> dict[str, float]:
    run = build_run(matched_recipe(model_dir, seed), with_trainer=False)
    return evaluate(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="steps the per-step figure averages")
    ap.add_argument("--budget-s", type=float, default=120.0, help="training seconds per trainer")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=1000, help="hard cap on steps per trainer")
    args = ap.parse_args()
    if args.steps < 1 or args.budget_s <= 0 or args.max_steps < args.steps:
        raise ValueError("need --steps >= 1, --budget-s > 0 and --max-steps >= --steps")
    torch.set_num_threads(args.threads)

    src = ensure_demo_checkpoint()
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        root = Path(tmp)
        start = initial_accuracy(fresh_checkpoint(src, root, "initial"), args.seed)
        print(f"warm checkpoint: greedy accuracy {start['eval/accuracy']:.3f}", flush=True)
        print(f"paired: {args.steps} TRL and rltool steps in turn:", flush=True)
        paired = run_paired(src, root, args.seed, args.steps)
        print(f"rltool, {args.budget_s:.0f} s budget:", flush=True)
        ours = run_rltool(
            fresh_checkpoint(src, root, "rltool"), args.seed, args.budget_s, args.max_steps
        )
        print(f"TRL GRPOTrainer, {args.budget_s:.0f} s budget:", flush=True)
        trl = run_trl(
            fresh_checkpoint(src, root, "trl"),
            args.seed,
            args.budget_s,
            args.max_steps,
            root / "trl_out",
        )
    report(ours, trl, start, paired, args)


def report(
    ours: Result,
    trl: Result,
    start: dict[str, float],
    paired: tuple[list[float], list[float]],
    args: argparse.Namespace,
) -> None:
    print(f"\nthreads {args.threads}, seed {args.seed}, 32 prompts x 8 samples per step")
    a, b = (statistics.mean(x) for x in paired)
    pairs = [t / r for r, t in zip(*paired, strict=True)]
    print(f"seconds per step, paired ({len(pairs)} steps each, taken in turn):")
    print(f"  rltool  {a:6.2f}   (median {statistics.median(paired[0]):.2f})")
    print(f"  trl     {b:6.2f}   (median {statistics.median(paired[1]):.2f})")
    print(f"  ratio trl/rltool  {b / a:.2f}   (per pair: median {statistics.median(pairs):.2f})")
    n = min(args.steps, len(ours.step_s), len(trl.step_s))
    if n < args.steps:
        print(f"note: the budget allowed only {n} steps for one trainer; per-step figure over {n}")
    a, b = ours.s_per_step(n), trl.s_per_step(n)
    print(f"seconds per step in the budget runs (mean of the first {n}, one run after the other):")
    print(f"  rltool  {a:6.2f}   (median {statistics.median(ours.step_s[:n]):.2f})")
    print(f"  trl     {b:6.2f}   (median {statistics.median(trl.step_s[:n]):.2f})")
    print(f"  ratio trl/rltool  {b / a:.2f}")
    print(
        f"held-out greedy accuracy (n={start['eval/n']:.0f}), start {start['eval/accuracy']:.3f}:"
    )
    for r in (ours, trl):
        e = r.eval
        print(
            f"  {r.name:6s}  {e['eval/accuracy']:.3f} after {len(r.step_s)} steps in "
            f"{r.train_s:.0f} s  (mean len {e['eval/response_len/mean']:.1f}, "
            f"truncated {e['eval/truncated_frac']:.2f})"
        )


if __name__ == "__main__":
    main()
