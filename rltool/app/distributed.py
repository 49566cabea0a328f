"""``rltool train`` on several processes: the relaunch through ``torch.distributed.run``
and the loop of the ranks other than the leader.

Rank 0 (the leader) runs the whole driver: production, evaluation, logging, metrics.
Every other rank holds its shard of the policy and optimizer and does what the leader's
messages (``run.tell``) say: fit a step's groups, gather weights, save, load, stop.
Design: docs/distributed.md
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from rltool.app.run import build_updater, seed_everything, trainer_model
from rltool.app.run_lock import HELD_ENV, RunLock
from rltool.app.sharded_checkpoint import restore_updater, write_sharded
from rltool.config.schema import RecipeConfig
from rltool.models import embedding_rows, load_model_and_tokenizer
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


def run_launcher(command: list[str], resume_dir: Path | None = None) -> int:
    """Run torch.distributed.run and return its status: 130 / 143 after Ctrl-C / SIGTERM,
    as on one process. Ctrl-C reaches it from the terminal and it passes the signal on to
    the ranks (the leader stops cleanly and saves); a SIGTERM sent to this process is
    forwarded to it. This process must not die first. A resumed run's directory is locked
    here, for the whole group (``RunInUseError`` before anything starts)."""
    if resume_dir is None:  # a new run: the leader locks the directory it creates
        return _launch(command)
    with RunLock(resume_dir):
        return _launch(command, {HELD_ENV: str(Path(resume_dir).resolve())}, resume_dir)


def _launch(
    command: list[str], env: dict[str, str] | None = None, run_dir: Path | None = None
) -> int:
    """torchrun's stderr (the ranks' too) passes through, read for the root cause of a
    failure: a rank that died is named, with its cause and the ``--resume`` line."""
    proc = subprocess.Popen(
        command, env={**os.environ, **(env or {})}, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    relay = threading.Thread(target=_relay, args=(proc.stderr, lines), daemon=True)
    relay.start()
    seen: list[int] = []

    def on_signal(sig: int, _frame: object) -> None:
        seen.append(sig)
        if sig == signal.SIGTERM:  # Ctrl-C reached torchrun already (same process group)
            proc.send_signal(sig)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = proc.wait()
        relay.join(timeout=10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if seen and status != 0:
        return 128 + seen[0]
    if status != 0 and (cause := root_cause(lines)) is not None:
        where = run_dir if run_dir is not None else "RUN_DIR (shown as the run starts)"
        print(
            f"error: {cause}; the group stopped. Continue from the newest complete "
            f"checkpoint with: rltool train --resume {where}",
            file=sys.stderr,
            flush=True,
        )
    return status


def _relay(stream, lines: list[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        lines.append(line)
        del lines[:-200]  # the root cause is in torchrun's last lines


_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?:.*\((SIG\w+)\))?")


def root_cause(lines: list[str]) -> str | None:
    """The rank and cause of torchrun's 'Root Cause (first observed failure)' block,
    e.g. ``rank 1 died (exit code -9, SIGKILL)``; None without such a block."""
    start = next((i for i in range(len(lines) - 1, -1, -1) if "Root Cause" in lines[i]), None)
    if start is None:
        return None
    rank = code = sig = None
    for line in lines[start:]:
        if rank is None and (m := _ROOT_RANK.match(line)):
            rank = m.group(1)
        elif code is None and (m := _ROOT_EXIT.match(line)):
            code, sig = m.group(1), m.group(2)
    if rank is None:
        return None
    how = f"exit code {code}" + (f", {sig}" if sig else "") if code is not None else "failed"
    verb = "was killed" if sig else "failed"
    return f"rank {rank} {verb} ({how})"


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
        seed_everything(recipe.trainer.seed, recipe.trainer.deterministic, recipe.trainer.threads)
        model, _, _ = load_model_and_tokenizer(recipe.model)
        conversion = ConversionConfig.from_recipe(recipe, vocab_size=embedding_rows(model))
        model = trainer_model(model, recipe, shard)
        updater = build_updater(recipe, model, shard)
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
                ready(shard)  # the leader's Run.close waits here too
                return
            else:
                raise AssertionError(f"unknown message from the leader: {kind!r}")
    finally:
        close_shard(shard)
