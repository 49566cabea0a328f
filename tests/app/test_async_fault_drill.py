"""The async fault drill: a short asynchronous run (generation one step ahead of training,
leftover groups in the replay buffer) killed with SIGKILL again and again at moments the
test does not choose, resumed each time until it finishes. Then, counting by group id over
the rollout dumps: every prompt drawn was trained at most once and none was lost (each is
trained, or still waiting in the final checkpoint), the prompts were drawn in the order a
fresh sampler gives (none skipped, none drawn twice), and each (step, kind) line is in
metrics.jsonl once.

The kill moments come from a seeded RNG: half through the driver's ``RLTOOL_FAULT`` hook at
a random phase and step (rltool/app/faults.py), half a plain ``kill -9`` from outside a
random delay after the attempt dumped a random step (mid-training, mid-generation,
mid-save, whatever the process is doing then). Design: docs/app.md#the-async-fault-drill
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from short_runs import short_train_args, start_cli

from rltool.app.checkpoint import load_trainer_state, open_checkpoint
from rltool.app.rollout_dumps import dump_path, meta_path
from rltool.produce.sampler import PromptSampler
from rltool.rollout.io import read_groups

RECIPE = str(Path(__file__).parents[2] / "recipes" / "gsm8k_tiny_async.yaml")
STEPS, SAVE_EVERY, EVAL_EVERY, PROMPTS = 8, 2, 4, 3
KILLS = 6  # kill -9 this many times (fewer if an attempt happens to finish first)
GROUP_ID = re.compile(r"^s(\d+)-g(\d+)-p(\d+)$")  # producer.py: step drawn, draw number, row


def _saved_step(run_dir: Path) -> int:
    """The step a resume starts from: the newest complete checkpoint's, else 0."""
    try:
        return open_checkpoint(run_dir).state.step
    except ValueError:  # none yet (NoCheckpointError): the run starts again at step 0
        return 0


def _ahead(saved: int) -> list[int]:
    """Steps the next kill may land in: the first half of what is left after the resume
    point, so that the kills spread over the run instead of piling up at one end."""
    last = min(STEPS, saved + max(SAVE_EVERY, (STEPS - saved + 1) // 2))
    return list(range(saved + 1, last + 1))


def _fault(rng: random.Random, saved: int) -> str:
    """A hook the run reaches after its resume point: a random phase of a random step."""
    point = rng.choice(["generate", "train", "save"])
    steps = _ahead(saved)
    if point == "save":  # saves happen every SAVE_EVERY steps and at the end
        steps = [s for s in steps if s % SAVE_EVERY == 0 or s == STEPS]
    return f"{point}@{rng.choice(steps)}"


def _kill_after_dump(proc: subprocess.Popen, run_dir: Path, step: int, delay: float) -> None:
    """``kill -9`` ``delay`` seconds after this attempt dumped step ``step``'s rollouts
    (training it, generating the next, saving or evaluating by then: whatever comes)."""
    started = time.time()
    meta = meta_path(run_dir, step)
    while not (meta.exists() and meta.stat().st_mtime >= started):
        if proc.poll() is not None:
            return
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)


def _attempt(args: list[str], run_dir: Path, rng: random.Random) -> tuple[int, str]:
    """One attempt, killed by a random hook or a random delay; (exit code, what was done)."""
    saved = _saved_step(run_dir)
    if saved == STEPS:  # killed after its last save: nothing left to kill
        how, proc = "resume of a finished run", start_cli(args)
    elif rng.random() < 0.5:
        how = _fault(rng, saved)
        proc = start_cli(args, fault=how)
    else:
        step, delay = rng.choice(_ahead(saved)), rng.uniform(0.0, 0.15)
        how = f"kill -9 {delay:.2f}s after step {step}'s dump"
        proc = start_cli(args)
        _kill_after_dump(proc, run_dir, step, delay)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode in (0, -signal.SIGKILL), out
    assert "Traceback" not in out, out
    return proc.returncode, f"{how}: exit {proc.returncode}"


def _trained_and_failed(run_dir: Path) -> tuple[list[str], list[str]]:
    """Group ids of every step's dump: those the trainer took, those filed FAILED."""
    trained, failed = [], []
    for step in range(1, STEPS + 1):
        meta = json.loads(meta_path(run_dir, step).read_text())
        groups = read_groups(dump_path(run_dir, step))
        ids = [g[0].group_id for g in groups]
        assert meta["step"] == step
        trained += ids[: meta["trained_groups"]]
        failed += ids[meta["trained_groups"] :]
    return trained, failed


@pytest.mark.slow
def test_async_run_killed_at_random_moments_trains_every_drawn_prompt_once(
    tiny_checkpoint, tmp_path
):
    first = short_train_args(
        RECIPE,
        tiny_checkpoint,
        tmp_path,
        STEPS,
        "rollout.backend=inprocess",  # a Ray cluster per attempt would take most of the time
        "produce.oversample=1.0",  # twice what a step trains: leftovers wait in the buffer
        "rollout.sampling.max_new_tokens=6",
        "rollout.eval_sampling.max_new_tokens=4",
        f"trainer.save_every={SAVE_EVERY}",
        f"trainer.eval_every={EVAL_EVERY}",
        "--dump-rollouts",
    )
    run_dir = tmp_path / "t"
    resume = ["train", "--resume", str(run_dir)]
    rng = random.Random(23)
    kills, rc, args, done = 0, -signal.SIGKILL, first, []
    while kills < KILLS and rc != 0:
        rc, what = _attempt(args, run_dir, rng)
        done.append(what)
        kills += rc != 0
        args = resume
    if rc != 0:
        proc = start_cli(resume)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
    assert kills >= KILLS // 2, f"only {kills} kills landed before the run finished: {done}"
    print("attempts:", *done, sep="\n  ")  # shown with pytest -s

    final = load_trainer_state(open_checkpoint(run_dir).path)
    assert final.step == STEPS
    producer = final.producer
    trained, failed = _trained_and_failed(run_dir)
    assert not failed  # nothing failed here: a FAILED group would be counted as settled
    # trained at most once: no group id twice across the steps' dumps
    twice = [gid for gid, n in Counter(trained).items() if n > 1]
    assert not twice, f"groups trained twice: {twice}"
    assert len(trained) == STEPS * PROMPTS
    # none lost: every group drawn is trained or still open (buffered or in flight)
    open_ids = [r["group_id"] for r in producer["open"]]
    assert not set(open_ids) & set(trained), "a trained group is still open"
    # and each open one is waiting somewhere: buffered, or in flight (sent again on resume)
    buffered = [
        json.loads(g[0])["group_id"]
        for q in ("completed", "aborted", "expired")
        for g in producer["buffer"][q]
    ]
    assert sorted(open_ids) == sorted(buffered + producer["in_flight"]), "an open group is lost"
    draws = {}
    for gid in trained + open_ids:
        _, n, row = map(int, GROUP_ID.match(gid).groups())
        assert n not in draws, f"draw {n} has two groups"
        draws[n] = row
    assert sorted(draws) == list(range(producer["drawn_groups"])), "a drawn group was lost"
    # the prompts are the sampler's, in its order: the prompt position resumed exactly
    (position,) = producer["sampler"]["tasks"].values()
    fresh = PromptSampler(position["size"], position["seed"])
    in_order = [draws[n] for n in sorted(draws)] == fresh.take(len(draws))
    assert in_order, (
        "the rows drawn are not the prompt sampler's order: a prompt skipped or redrawn"
    )
    assert (fresh.epoch, fresh.index) == (position["epoch"], position["index"])
    acct = producer["accounting"]
    assert acct["final"]["trained"] == len(trained) * 2  # group_size 2

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = [(x["step"], x["kind"]) for x in lines]
    assert len(keys) == len(set(keys)), Counter(keys).most_common(3)
    assert sorted(k for k in keys if k[1] == "train") == [(s, "train") for s in range(1, 9)]
    assert sorted(k for k in keys if k[1] == "eval") == [(0, "eval"), (4, "eval"), (8, "eval")]
