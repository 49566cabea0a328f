"""Command lines for short `rltool train` runs in tests: a few steps, tiny batches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cli_runner import wide_environ

import rltool

MAIN = "from rltool.cli.app import main; main()"


def short_train_args(
    recipe: str | Path, ckpt: Path, run_dir: Path, steps: int, *extra: str
) -> list[str]:
    """`rltool train RECIPE` on ``ckpt`` for ``steps`` steps of 3 prompts x 2 samples, no
    evaluation between steps, no time budget; ``extra`` overrides or flags come last."""
    return [
        "train",
        str(recipe),
        f"model.path={ckpt}",
        f"logging.run_dir={run_dir}",
        "logging.name=t",
        f"trainer.steps={steps}",
        "trainer.eval_every=0",
        "trainer.time_budget_s=null",
        "data.prompts_per_step=3",
        "data.group_size=2",
        "data.eval_limit=4",
        "optimizer.init_from_checkpoint=false",
        "trainer.pack_max_length=256",
        *extra,
    ]


GSM8K_TINY = Path(__file__).parents[1] / "recipes" / "gsm8k_tiny.yaml"


def short_gsm8k_args(
    ckpt: Path, run_dir: Path, steps: int, *extra: str, new_tokens: int = 4
) -> list[str]:
    """``short_train_args`` on the demo recipe, answers and evaluations cut to
    ``new_tokens`` tokens."""
    return short_train_args(
        GSM8K_TINY,
        ckpt,
        run_dir,
        steps,
        f"rollout.sampling.max_new_tokens={new_tokens}",
        f"rollout.eval_sampling.max_new_tokens={new_tokens}",
        *extra,
    )


def start_cli(args: list[str], fault: str | None = None) -> subprocess.Popen:
    """`rltool ARGS` in a child process (one torch thread, output merged, unwrapped), with
    the fault hook ``fault`` armed (``RLTOOL_FAULT``, rltool/app/faults.py) or none."""
    env = wide_environ(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(rltool.__file__).parents[1]))
    env.pop("RLTOOL_FAULT", None)
    if fault is not None:
        env["RLTOOL_FAULT"] = fault
    return subprocess.Popen(
        [sys.executable, "-c", MAIN, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
