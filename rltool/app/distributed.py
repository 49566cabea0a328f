"""``rltool train`` on several processes: the relaunch through ``torch.distributed.run``
and the loop of the ranks other than the leader.

Rank 0 (the leader) runs the whole driver: production, evaluation, logging, metrics.
Every other rank holds its shard of the policy and optimizer and does what the leader's
messages (``run.tell``) say: fit a step's groups, gather weights, save, load, stop.
Design: docs/distributed.md
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rltool.app.run import build_updater, seed_everything, trainer_model
from rltool.app.sharded_checkpoint import restore_updater, write_sharded
from rltool.config.schema import RecipeConfig
from rltool.models import load_model_and_tokenizer
from rltool.training.controller import TrainingController
from rltool.training.convert import ConversionConfig
from rltool.training.sharding import (
    close_shard,
    copy_full_weights,
    init_shard,
    launched_world_size,
    ready,
    receive,
)


def relaunch_command(recipe: RecipeConfig, argv: list[str]) -> list[str] | None:
    """The ``torch.distributed.run`` command that runs ``rltool <argv>`` on
    ``distributed.nproc_per_node`` processes; None when this process trains itself (one
    process, or already started by torchrun: it joins the group it is given)."""
    cfg = recipe.distributed
    if launched_world_size() > 1 or (cfg.nproc_per_node == 1 and cfg.nnodes == 1):
        return None
    if cfg.nnodes > 1:
        raise ValueError(
            f"distributed.nnodes={cfg.nnodes}: start the run on every node with torchrun, "
            f"e.g. torchrun --nnodes {cfg.nnodes} --nproc_per_node {cfg.nproc_per_node} "
            "--rdzv_backend c10d --rdzv_endpoint HOST:29500 -m rltool.cli.app train ..."
        )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={cfg.nproc_per_node}",
        "-m",
        "rltool.cli.app",
        *argv,
    ]


def run_launcher(command: list[str]) -> int:
    """Run torch.distributed.run and return its status: 130 / 143 after Ctrl-C / SIGTERM,
    as on one process. Ctrl-C reaches it from the terminal and it passes the signal on to
    the ranks (the leader stops cleanly and saves); a SIGTERM sent to this process is
    forwarded to it. This process must not die first."""
    proc = subprocess.Popen(command)
    seen: list[int] = []

    def on_signal(sig: int, _frame: object) -> None:
        seen.append(sig)
        if sig == signal.SIGTERM:  # Ctrl-C reached torchrun already (same process group)
            proc.send_signal(sig)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + seen[0] if seen and status != 0 else status


def is_follower() -> bool:
    """This process is a rank other than 0 of a group torchrun started."""
    return launched_world_size() > 1 and int(os.environ.get("RANK", "0")) != 0


def follow(recipe: RecipeConfig) -> None:
    """A non-leader rank: build the sharded trainer, then obey the leader until ``stop``."""
    shard = init_shard(recipe.distributed)
    assert shard is not None and not shard.leader
    # a stop is the leader's decision: it finishes the step and saves with our help, then
    # says stop (torchrun passes SIGINT / SIGTERM to every rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ready(shard)  # the leader has built the model files (builtin:)
        seed_everything(recipe.trainer.seed, recipe.trainer.deterministic)
        model, _, _ = load_model_and_tokenizer(recipe.model)
        model = trainer_model(model, recipe, shard)
        updater = build_updater(recipe, model, shard)
        conversion = ConversionConfig.from_recipe(recipe)
        controller = TrainingController(updater, conversion, seed=recipe.trainer.seed)
        while True:
            kind, arg = receive(shard)
            if kind == "fit":
                groups, train_step = arg
                controller.fit(groups, train_step=train_step)
            elif kind == "weights":
                copy_full_weights(model, None)
            elif kind == "save":
                write_sharded(Path(arg), model, updater.optimizer, shard)
            elif kind == "load":
                restore_updater(Path(arg), model, updater.optimizer, updater.scheduler, shard)
            elif kind == "stop":
                return
            else:
                raise AssertionError(f"unknown message from the leader: {kind!r}")
    finally:
        close_shard(shard)
