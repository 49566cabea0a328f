"""Killing a Ray rollout worker in the middle of ``rltool train``: the run says so in one
line, restarts the worker, finishes every step, and every group the dead worker had in
flight is retried (or counted failed), none lost.

The end-to-end drill is slow (a local Ray, two worker processes, a restart); the
report lines and the reading of Ray's death message are checked without Ray.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import ray
from cli_runner import run_cli
from short_runs import short_train_args

from rltool.app import run as run_module
from rltool.app.checkpoint import latest_checkpoint, load_trainer_state
from rltool.produce.backend import GroupOutcome, GroupRequest, WorkerDeath
from rltool.produce.ray_backend import RayBackend
from rltool.produce.ray_deaths import exit_reason
from rltool.produce.result import GroupError
from rltool.report.train_view import death_line, error_lines
from rltool.rollout.io import read_groups

RECIPE = str(Path(__file__).parents[2] / "recipes" / "gsm8k_tiny_async.yaml")

# Ray's message for an actor whose process was killed with SIGKILL (ray 2.60)
SIGKILLED = (
    "The actor died unexpectedly before finishing this task.\n"
    "\tclass_name: _WorkerActor\n\tpid: 22676\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
    "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of "
    "file. Some common causes include: (1) the process was killed by the OOM killer due to "
    "high memory usage, (2) ray stop --force was called, or (3) the worker crashed."
)


# --- the report, without Ray --------------------------------------------------------------


def test_exit_reason_keeps_what_ray_knows_in_a_few_words():
    assert exit_reason(RuntimeError(SIGKILLED)) == (
        "killed or crashed (Ray: Worker unexpectedly exits with a connection error code 2. "
        "End of file.)"
    )
    by_ray_kill = (
        "The actor died unexpectedly before finishing this task.\n\tpid: 12\n"
        "The actor is dead because it was killed by `ray.kill`."
    )
    assert exit_reason(RuntimeError(by_ray_kill)) == "it was killed by `ray.kill`"
    intended = "x\nWorker exit type: INTENDED_USER_EXIT Worker exit detail: exit() called."
    assert exit_reason(RuntimeError(intended)) == "INTENDED_USER_EXIT (Ray: exit() called.)"
    assert exit_reason(RuntimeError("")) == "RuntimeError"


def _err(gid: str, error: str, retried: bool = True, attempt: int = 0) -> GroupError:
    return GroupError(gid, attempt, "worker-1", error, retried)


def test_one_line_per_death_with_the_fate_of_its_groups():
    death = WorkerDeath("worker-1", "killed or crashed", "worker worker-1 died: x", 4.26)
    lost = [_err(g, death.error) for g in ("a", "b", "c")] + [_err("d", death.error, False, 1)]
    assert death_line(death, lost) == (
        "rollout worker-1 died: killed or crashed; restarted in 4.3 s; 4 in-flight groups: "
        "3 retried, 1 counted failed (second failure)"
    )
    assert death_line(death, lost[:1]) == (
        "rollout worker-1 died: killed or crashed; restarted in 4.3 s; 1 in-flight group retried"
    )
    assert death_line(death, []).endswith("restarted in 4.3 s; no group in flight")


def test_error_lines_fold_a_deaths_groups_into_its_line_and_group_other_errors():
    death = WorkerDeath("worker-1", "killed", "worker worker-1 died: x", 1.0)
    raised = "worker worker-0 raised: ValueError: bad row"
    errors = [
        _err("g1", death.error),
        _err("g2", raised),
        _err("g3", death.error),
        _err("g4", raised, retried=False, attempt=1),
        _err("g5", raised),
        _err("g6", raised),
        _err("g7", "worker worker-0 call failed: lost"),
    ]
    assert error_lines(errors, [death]) == [
        "rollout worker-1 died: killed; restarted in 1.0 s; 2 in-flight groups retried",
        f"rollout: 4 groups (g2, g4, g5, ...): {raised}; 3 retried, 1 counted failed "
        "(second failure)",
        "rollout: group g7 (attempt 0): worker worker-0 call failed: lost; retrying it",
    ]
    assert error_lines([], []) == []


# --- the drill: rltool train, two Ray workers, kill -9 one of them after step 1 ------------


class KillDrill:
    """Wraps the run's Ray backend: after the first weight sync (step 1 trained), the next
    submit is followed at once by ``kill -9`` of ``victim``'s process, so its share of those
    groups is in flight when it dies. Records what it lost and what came back."""

    def __init__(self, backend: RayBackend, victim: str = "worker-1"):
        self.backend, self.victim = backend, victim
        self.pid = backend.worker_pids()[victim]
        self.synced = self.killed = False
        self.lost: list[GroupOutcome] = []  # error outcomes collected
        self.after_kill: list[GroupRequest] = []  # everything submitted after the kill
        submit, collect, update = backend.submit, backend.collect, backend.update_weights

        def update_weights(state_dict, model_step):
            update(state_dict, model_step)
            self.synced = True

        def submit_then_kill(requests):
            if self.killed:
                self.after_kill += requests
            submit(requests)
            if self.synced and not self.killed:
                self.killed = True
                os.kill(self.pid, signal.SIGKILL)

        def collect_and_record(*args, **kwargs):
            out = collect(*args, **kwargs)
            self.lost += [o for o in out if o.error is not None]
            return out

        backend.update_weights = update_weights
        backend.submit = submit_then_kill
        backend.collect = collect_and_record


def _train_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train"]


@pytest.mark.slow
def test_killed_ray_worker_is_reported_restarted_and_loses_no_group(
    tiny_checkpoint, tmp_path, monkeypatch
):
    drills: list[KillDrill] = []
    build = run_module.build_backend

    def build_backend(recipe, model, tokenizer):
        backend = build(recipe, model, tokenizer)
        drills.append(KillDrill(backend))
        return backend

    monkeypatch.setattr(run_module, "build_backend", build_backend)
    steps, prompts, group_size = 4, 3, 2
    args = short_train_args(
        RECIPE,
        tiny_checkpoint,
        tmp_path,
        steps,
        "rollout.num_workers=2",
        f"data.prompts_per_step={prompts}",
        f"data.group_size={group_size}",
        "--dump-rollouts",
    )
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    assert not ray.is_initialized(), "the run left its local Ray running"
    (drill,) = drills
    assert drill.killed

    # the run went on: every step trained, the worker restarted once
    run_dir = tmp_path / "t"
    lines = _train_lines(run_dir)
    assert [x["step"] for x in lines] == list(range(1, steps + 1))
    assert lines[-1]["workers/restarts"] == 1.0
    lost_ids = sorted(o.request.group_id for o in drill.lost)
    assert lost_ids, "the killed worker had no group in flight: the drill missed"
    assert {o.worker for o in drill.lost} == {"worker-1"}
    assert lines[-1]["workers/lost_requests"] == len(lost_ids)
    assert sum(x["produce/errors"] for x in lines) == len(lost_ids)

    # the terminal says so once, in one line naming the worker, with the fate of its groups
    out = result.output
    assert out.count("rollout worker-1 died") == 1, result.output
    n = len(lost_ids)
    assert "rollout worker-1 died: killed or crashed (Ray: " in out, result.output
    assert "restarted in" in out
    assert f"{n} in-flight group{'s' if n > 1 else ''} retried" in out
    assert "rollout: group" not in out  # no per-group lines for a death

    # its groups were generated again (attempt 1) and trained; nothing else was retried
    retried = sorted(r.group_id for r in drill.after_kill if r.attempt == 1)
    assert retried == lost_ids
    dumps = sorted((run_dir / "rollouts").glob("step_*.jsonl"))
    trained = [g[0].group_id for d in dumps for g in read_groups(d)]
    assert len(trained) == len(set(trained)) == steps * prompts
    assert set(lost_ids) <= set(trained)

    # accounting: every group drawn is trained or still open (buffered / in flight), once
    state = load_trainer_state(latest_checkpoint(run_dir)).producer
    open_ids = [r["group_id"] for r in state["open"]]
    drawn = {f"g{k}" for k in range(state["drawn_groups"])}
    assert sorted(g.split("-")[1] for g in trained + open_ids) == sorted(drawn)
    acct = state["accounting"]
    assert acct["final"] == {"trained": steps * prompts * group_size}
    assert acct["taken"] == acct["final"]["trained"] + len(acct["open"])
