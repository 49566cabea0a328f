"""SandboxLoop: agent then check in a sandbox; reward from the check; failures contained."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from loop_fakes import ContextEngine, decode, spans
from transformers import AutoTokenizer

from rltool.agent_loops.base import AGENT_LOOPS, LoopContext
from rltool.agent_loops.evaluation import EvaluationFailed
from rltool.agent_loops.sandbox import (
    SandboxLoop,
    memory_bound_line,
    resolve_script,
    sandbox_python,
)
from rltool.agent_loops.sandbox_task import CodingTask
from rltool.builtin import demo_cache_dir
from rltool.config.schema import SamplingConfig
from rltool.data import load_examples
from rltool.demo.data import CODING_TASKS_FILE
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.rollout.contract import check_group, check_sample, errors
from rltool.rollout.state import IGNORE_INDEX, Status
from rltool.sandbox import SandboxLimits, SandboxPool, SandboxSpec

REPO = Path(__file__).resolve().parents[2]
RLTOOL = [sys.executable, "-c", "from rltool.cli.app import main; main()"]
TASKS = load_examples([CODING_TASKS_FILE])
ADD = next(t for t in TASKS if t["name"] == "add")
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"
BROKEN = "def add(a, b) return a + b"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

# A stand-in agent: one model call over the socket (stdlib only), then whatever ACTION says.
SCRIPTED_AGENT = """
import http.client, json, os, socket, sys, time
from urllib.parse import urlsplit

class Conn(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(os.environ["RLTOOL_SESSION_SOCKET"])

conn = Conn("localhost")
path = urlsplit(os.environ["RLTOOL_BASE_URL"]).path + "/chat/completions"
body = json.dumps({"messages": [{"role": "user", "content": "solve it"}]})
conn.request("POST", path, body, {"Content-Type": "application/json"})
assert conn.getresponse().status == 200
ACTION
"""
WRITE_ADD = 'open("solution.py", "w").write("def add(a, b):\\n    return a + b\\n")'


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer()


@pytest.fixture
def work_parent(tmp_path: Path):
    """Sandbox work dirs go here; afterwards none is left and no sandbox process lives."""
    path = tmp_path / "work"
    path.mkdir()
    yield path
    assert list(path.iterdir()) == []
    assert _processes_mentioning(str(path)) == []


def _processes_mentioning(needle: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if needle.encode() in cmdline:
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


def agent_script(tmp_path: Path, action: str) -> str:
    path = tmp_path / "agent.py"
    path.write_text(SCRIPTED_AGENT.replace("ACTION", action))
    return str(path)


def make_loop(tokenizer, work_parent, reply=lambda context: BROKEN, **options) -> SandboxLoop:
    engine = ContextEngine(tokenizer, reply)
    options = {"max_concurrent": 4, "work_parent": str(work_parent), **options}
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=64), task_name="sandbox")
    return SandboxLoop(ctx, **options)


# --- shipped data and options ------------------------------------------------------------------


def test_every_shipped_reference_solution_passes_its_check_and_the_stub_fails(work_parent):
    python, binds = sandbox_python("auto")
    assert len(TASKS) == 6
    with SandboxPool(4) as pool:
        for record in TASKS:
            task = CodingTask.from_record(record, record["name"])
            check_dir = work_parent.parent / f"check-{record['name']}"
            check_dir.mkdir(mode=0o755)
            for name, text in task.check_files.items():
                (check_dir / name).write_text(text)
            check = [a.replace("{python}", python) for a in task.check]
            for content, passes in ((record["answer"], True), (task.files["solution.py"], False)):
                spec = SandboxSpec(
                    command=[python, "-c", "pass"],
                    files={task.solution_file: content},
                    ro_binds=binds,
                    work_parent=work_parent,
                )
                run = pool.run_check(spec, check, ro_binds=[(check_dir, "/check")])
                assert run.passed == passes, (record["name"], run.check.stderr)


def test_registered_and_options_are_checked(tokenizer, work_parent):
    assert AGENT_LOOPS.get("sandbox") is SandboxLoop
    assert resolve_script("rltool.agents.sandbox_coder").name == "sandbox_coder.py"
    with pytest.raises(ValueError, match="neither a file nor a module"):
        resolve_script("no.such.module")
    with pytest.raises(ValueError, match=r"options\.python must be auto, system or host"):
        sandbox_python("conda")
    with pytest.raises(ValueError, match=r"options\.limits: .*unexpected keyword"):
        make_loop(tokenizer, work_parent, limits={"wall_clock": 3})
    with pytest.raises(ValueError, match=r"field 'check' must be a non-empty list"):
        CodingTask.from_record({**ADD, "check": "python3 check.py"}, "tasks.jsonl:1")


def test_the_memory_bound_of_the_agent_sandboxes_is_shown(tokenizer, work_parent, caplog):
    limits = SandboxLimits(memory_bytes=1 << 30, max_processes=8, tmp_bytes=64 << 20)
    line = memory_bound_line(limits, 4)
    assert "each agent sandbox can hold at most 8.1 GiB (max_processes 8 x memory_bytes" in line
    assert "4 at once: 32.5 GiB" in line
    with caplog.at_level("INFO", logger="rltool.agent_loops.sandbox"):
        make_loop(tokenizer, work_parent, limits={"memory_bytes": 1 << 20, "max_processes": 4})
    (record,) = [r for r in caplog.records if "sandbox can hold" in r.getMessage()]
    assert "at most 0.1 GiB" in record.getMessage() and record.levelname == "INFO"


# --- the loop -----------------------------------------------------------------------------------


def test_shipped_agent_fixes_its_solution_on_the_second_turn(tokenizer, work_parent):
    """The model's first reply does not run; the error goes back; the second reply passes."""
    loop = make_loop(tokenizer, work_parent, reply=lambda c: GOOD if "failed:" in c else BROKEN)
    (group,) = loop.generate_groups([ADD], 2, ["s1-p0"])
    assert errors(check_group(group)) == [] and len(group) == 2
    for i, s in enumerate(group):
        assert s.status == Status.COMPLETED, s.error
        assert (s.session_id, s.task_name, s.agent_loop) == (f"s1-p0.{i}", "sandbox", "sandbox")
        assert s.reward["score"] == 1.0 and s.reward["passed"] is True
        assert s.reward["check_output"] == "add: 3 cases passed\n"
        assert s.extra["num_turns"] == 2 and s.extra["agent"]["status"] == "ok"
        assert "turn 0: 26 chars, run: failed" in s.extra["agent"]["stdout"]
        assert check_sample(s) == []
        (a1, b1), (a2, b2) = spans(s)[0]
        assert decode(tokenizer, s.input_ids[a1:b1]) == BROKEN + "<|im_end|>"
        feedback = decode(tokenizer, s.input_ids[b1:a2])
        assert feedback.startswith("\n<|im_start|>user\nRunning solution.py failed:\n")
        assert "SyntaxError" in feedback and set(s.labels[b1:a2]) == {IGNORE_INDEX}
        assert decode(tokenizer, s.input_ids[a2:b2]) == GOOD + "<|im_end|>"
    metrics = loop.pop_metrics()
    assert metrics["sandbox/check_pass_rate"] == 1.0 and metrics["agent/turns_per_session"] == 2


def test_wrong_solution_scores_zero_with_the_check_output(tokenizer, work_parent):
    loop = make_loop(tokenizer, work_parent, max_turns=1)
    ((s, *_),) = loop.generate_groups([ADD], 1, ["g"])
    assert s.status == Status.COMPLETED and s.reward["score"] == 0.0
    assert s.reward["check_exit_code"] == 1 and "SyntaxError" in s.reward["check_output"]
    assert spans(s)[1] == []  # one turn: a single supervised run


def test_scripted_agent_with_a_correct_solution_gets_reward_one(tokenizer, work_parent, tmp_path):
    loop = make_loop(tokenizer, work_parent, agent_script=agent_script(tmp_path, WRITE_ADD))
    (group,) = loop.generate_groups([ADD], 3, ["g"])
    assert [s.reward["score"] for s in group] == [1.0, 1.0, 1.0]
    assert all(s.status == Status.COMPLETED for s in group)


def test_timeout_crash_and_no_model_call_fail_only_their_samples(tokenizer, work_parent, tmp_path):
    sleepy = make_loop(
        tokenizer,
        work_parent,
        agent_script=agent_script(tmp_path, "time.sleep(60)"),
        limits={"wall_clock_s": 1.0},
    )
    ((s,),) = sleepy.generate_groups([ADD], 1, ["slow"])
    assert s.status == Status.FAILED and s.reward is None
    assert (
        s.error == "agent: sandbox timeout: the wall clock of 1.0 s ran out; the sandbox was killed"
    )
    assert s.input_ids is not None and errors(check_sample(s)) == []  # its turn was recorded
    assert s.extra["agent"]["status"] == "timeout"

    crash = make_loop(tokenizer, work_parent, agent_script=agent_script(tmp_path, "sys.exit(3)"))
    ((s,),) = crash.generate_groups([ADD], 1, ["crash"])
    assert s.status == Status.FAILED and s.error.startswith("agent: exited 3")

    mute = tmp_path / "mute.py"
    mute.write_text(WRITE_ADD + "\n")
    quiet = make_loop(tokenizer, work_parent, agent_script=str(mute))
    ((s,),) = quiet.generate_groups([ADD], 1, ["mute"])
    assert s.status == Status.FAILED and s.input_ids is None
    assert s.error == "agent: made no model call; nothing to train on"
    assert quiet.pop_metrics()["sandbox/agent_failed"] == 0


def test_evaluate_counts_passed_checks(tokenizer, work_parent):
    loop = make_loop(tokenizer, work_parent, reply=lambda c: GOOD)
    is_even = next(t for t in TASKS if t["name"] == "is_even")
    metrics = loop.evaluate([ADD, is_even], SamplingConfig(temperature=0.0))
    # rows [1, 0]: a resample of both rows is all 1 (or all 0) with chance 1/4: interval [0, 1]
    assert metrics == {
        "eval/accuracy": 0.5,
        "eval/accuracy_ci_low": 0.0,
        "eval/accuracy_ci_high": 1.0,
        "eval/failed": 0.0,
        "eval/n": 2.0,
    }


def test_evaluate_in_which_every_session_fails_is_an_error(tokenizer, work_parent, tmp_path):
    crash = agent_script(tmp_path, "sys.exit(3)")
    loop = make_loop(tokenizer, work_parent, agent_script=crash)
    with pytest.raises(EvaluationFailed) as info:
        loop.evaluate([ADD, ADD], SamplingConfig(temperature=0.0))
    assert str(info.value) == (
        "evaluation of task 'sandbox': all 2 samples failed: agent: exited 3 (2)"
    )


# --- the CLI end to end ------------------------------------------------------------------------


@pytest.mark.slow
def test_train_dump_validate_inspect_sandbox_recipe(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as in test_localhost's CLI test
    train = subprocess.run(
        [*RLTOOL, "train", "recipes/sandbox_code.yaml", "trainer.steps=2",
         "data.prompts_per_step=2", "data.group_size=2", "data.eval_limit=2",
         "rollout.sampling.max_new_tokens=24", "rollout.eval_sampling.max_new_tokens=24",
         "trainer.eval_every=0", f"logging.run_dir={tmp_path}", "--dump-rollouts", "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    dumps = sorted(tmp_path.glob("sandbox_code/rollouts/step_*.jsonl"))
    assert len(dumps) == 2
    validate = subprocess.run(
        [*RLTOOL, "validate-rollouts", *map(str, dumps)], cwd=REPO, env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert validate.returncode == 0, validate.stdout[-3000:]
    rows = [json.loads(line) for d in dumps for line in d.read_text().splitlines()]
    assert {r["task_name"] for r in rows} == {"coding"}
    assert all("check_output" in r["reward"] for r in rows if r["status"] == "COMPLETED")
    tokenizer = AutoTokenizer.from_pretrained(demo_cache_dir(), local_files_only=True)
    gaps_seen = 0
    for dump in dumps:  # shifted targets: first reply, masked error feedback, second reply
        inspect = subprocess.run(
            [*RLTOOL, "inspect-batch", str(dump), "--format", "json"], cwd=REPO, env=env,
            capture_output=True, text=True,
        )  # fmt: skip
        assert inspect.returncode == 0, inspect.stderr[-3000:]
        for sample in json.loads(inspect.stdout)["samples"]:
            ids, sup = np.asarray(sample["input_ids"]), np.asarray(sample["targets"]) != -100
            edges = np.flatnonzero(np.diff(np.r_[0, sup.astype(int), 0]))  # start, end, ...
            for end, start in zip(edges[1:-1:2], edges[2::2], strict=True):
                masked = tokenizer.decode(ids[end + 1 : start + 1].tolist())
                assert "Running solution.py failed:" in masked, masked
                gaps_seen += 1
    assert gaps_seen > 0  # the tiny model's Python never runs: every agent takes 2 turns


@pytest.mark.skipif(os.geteuid() != 0, reason="the tmpfs work dir needs root")
def test_disk_quota_from_the_options_fails_only_that_sample(tokenizer, work_parent, tmp_path):
    """options.limits.disk_bytes reaches the sandbox: an agent writing past it ends LIMIT."""
    hog = 'open("big", "wb").write(bytes(2 << 20))'
    loop = make_loop(
        tokenizer,
        work_parent,
        agent_script=agent_script(tmp_path, hog),
        limits={"disk_bytes": 1 << 20},
    )
    assert loop.limits.disk_bytes == 1 << 20
    ((s,),) = loop.generate_groups([ADD], 1, ["hog"])
    assert s.status == Status.FAILED and s.reward is None
    assert s.error.startswith("agent: sandbox limit: disk quota of 1048576 bytes exceeded")
    assert s.extra["agent"]["status"] == "limit"
