"""``inspect-batch FILE --model PATH_OR_RUN``: the trainer's logprobs recomputed with a model
beside the rollout's, per supervised token, with MoE routing disagreement (tiny random
models; expected values from an independent plain forward)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from short_runs import short_gsm8k_args
from tiny_models import random_moe

from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.moe import find_routers, recording
from rltool.rollout.state import RolloutState

PROMPT = [10, 11, 12]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe-inspect")
    tokenizer = train_demo_tokenizer()
    model = random_moe(len(tokenizer), "qwen3_moe")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def own_routing(model: torch.nn.Module, ids: list[int]) -> list:
    """The model's own experts for each input of ``ids`` ([T, L, k], last row -1)."""
    with torch.no_grad(), recording(model, find_routers(model)) as seen:
        model(input_ids=torch.tensor([ids[:-1]]))
    rows = seen[0][0].tolist()  # [T - 1, L, k]
    return [*rows, [[-1] * len(rows[0][0])] * len(rows[0])]


def plain_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log p(ids[t + 1] | ids[: t + 1]) for every t, from one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].float()  # [T - 1, V]
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def write_samples(path: Path, routed: dict[str, list] | None = None) -> dict[str, list[int]]:
    samples = {"a": [*PROMPT, 20, 21, 22], "b": [*PROMPT, 23, 24]}
    lines = []
    for rid, ids in samples.items():
        response = ids[3:]
        s = RolloutState(
            rollout_id=rid,
            group_id="g",
            prompt_ids=PROMPT,
            response_ids=response,
            input_ids=ids,
            labels=[-100] * 3 + response,
            logprobs=[0.0] * 3 + [-1.0] * len(response),
            routed_experts=None if routed is None else routed[rid],
            reward={"score": float(rid == "a")},
            status="COMPLETED",
        )
        lines.append(s.to_json())
    path.write_text("\n".join(lines) + "\n")
    return samples


def inspect_json(path: Path, model: Path, *args: str) -> dict:
    cmd = ["inspect-batch", str(path), "--model", str(model), "--format", "json", *args]
    result = run_cli(cmd)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_dense_model_logprobs_match_a_plain_forward(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    samples = write_samples(tmp_path / "r.jsonl")
    got = inspect_json(tmp_path / "r.jsonl", tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    assert {k: v for k, v in got["model"].items() if k != "rollout_correction"} == {
        "path": str(tiny_checkpoint),
        "step": None,
        "temperature": 1.0,
        "routing_replay": False,
        "moe_layers": None,
    }
    # the recipe default: tis_cap 2.0, i.e. token_tis
    assert got["model"]["rollout_correction"]["weights"] == "token"
    assert [s["rollout_id"] for s in got["samples"]] == ["a", "b"]
    for s in got["samples"]:
        ids = samples[s["rollout_id"]]
        # supervised targets sit at shifted positions 2.. (target j = ids[j + 1])
        assert s["positions"] == list(range(2, len(ids) - 1))
        assert s["token_ids"] == ids[3:]
        assert s["rollout_logprobs"] == [-1.0] * len(ids[3:])
        want = plain_logprobs(model, ids)[2:]
        assert s["trainer_logprobs"] == pytest.approx(want, abs=1e-5)
        assert s["delta"] == pytest.approx([w + 1.0 for w in want], abs=1e-5)
        assert s["routing_layers_differ"] is None and s["masked"] is None
        assert s["weights"] == pytest.approx([min(math.exp(d), 2.0) for d in s["delta"]], abs=1e-6)
    worst = got["worst"]
    assert len(worst) == 5 and abs(worst[0]["delta"]) >= abs(worst[-1]["delta"])
    assert {"rollout_id", "position", "token_id", "delta"} <= set(worst[0])
    one = inspect_json(tmp_path / "r.jsonl", tiny_checkpoint, "--limit", "1")
    assert [s["rollout_id"] for s in one["samples"]] == ["a"]


def test_correction_columns_are_the_updaters(tiny_checkpoint, tmp_path):
    """token_tis: w = min(exp(Δ), 2) per token; seq_mis: w = min(exp(sum Δ), 2) for every
    token of the sample, rejected whole when sum -Δ is outside [log 0.5, log 2]."""
    write_samples(tmp_path / "r.jsonl")
    tis = inspect_json(tmp_path / "r.jsonl", tiny_checkpoint, "--rollout-correction", "token_tis")
    assert tis["model"]["rollout_correction"]["weights"] == "token"
    for s in tis["samples"]:
        want = [min(math.exp(d), 2.0) for d in s["delta"]]
        assert s["weights"] == pytest.approx(want, rel=1e-4, abs=1e-6)
        assert s["masked"] is None
    mis = inspect_json(tmp_path / "r.jsonl", tiny_checkpoint, "--rollout-correction", "seq_mis")
    for s in mis["samples"]:
        total = sum(s["delta"])  # a random model: far below the rollout's -1.0 per token
        assert total < math.log(0.5)
        want = min(math.exp(max(total, -20.0)), 2.0)
        assert s["weights"] == pytest.approx([want] * len(s["delta"]), rel=1e-4, abs=1e-6)
        assert s["masked"] == [True] * len(s["delta"])
    bad = run_cli(["inspect-batch", str(tmp_path / "r.jsonl"), "--model", str(tiny_checkpoint),
         "--rollout-correction", "nope"],
    )  # fmt: skip
    assert bad.exit_code == 2 and "algorithm.rollout_correction" in bad.stderr


def test_moe_routing_disagreement_per_token_and_replay(moe_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    ids = {"a": [*PROMPT, 20, 21, 22], "b": [*PROMPT, 23, 24]}
    routed = {rid: own_routing(model, x) for rid, x in ids.items()}
    layer1 = routed["a"][3][1]
    routed["a"][3][1] = [e for e in range(8) if e not in layer1][:2]  # input 3, layer 1 moved
    path = tmp_path / "r.jsonl"
    write_samples(path, routed)
    off = "--prefix-sharing", "off"
    got = inspect_json(path, moe_dir, *off)
    a, b = got["samples"]
    assert got["model"]["moe_layers"] == 2 and got["model"]["routing_replay"] is False
    assert a["routing_layers_differ"] == [0, 1, 0]  # positions 2, 3, 4: only input 3, 1 layer
    assert b["routing_layers_differ"] == [0, 0]
    assert a["summary"]["routing_differs_frac"] == pytest.approx(1 / 3, abs=1e-6)
    assert a["trainer_logprobs"] == pytest.approx(plain_logprobs(model, ids["a"])[2:], abs=1e-5)
    # replaying the recorded routing changes input 3's forward: its target and later ones
    replayed = inspect_json(path, moe_dir, *off, "--replay-routing")
    ra = replayed["samples"][0]
    assert replayed["model"]["routing_replay"] is True
    assert ra["routing_layers_differ"] == [0, 1, 0]  # measured on the model's own routing
    assert ra["trainer_logprobs"][0] == pytest.approx(a["trainer_logprobs"][0], abs=1e-6)
    assert abs(ra["trainer_logprobs"][1] - a["trainer_logprobs"][1]) > 1e-4
    assert replayed["samples"][1]["trainer_logprobs"] == pytest.approx(
        b["trainer_logprobs"], abs=1e-5
    )


def test_rich_view_and_errors(moe_dir, tiny_checkpoint, tmp_path):
    path = tmp_path / "r.jsonl"
    write_samples(path)
    cmd = ["inspect-batch", str(path), "--model", str(tiny_checkpoint), "--limit", "1"]
    result = run_cli(cmd)
    assert result.exit_code == 0, result.output
    assert "a: 3 supervised tokens, mean |Δ|" in result.stdout
    assert "largest |Δ|" in result.stdout and "b:" not in result.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = run_cli(["inspect-batch", str(path), "--model", str(empty)])
    assert bad.exit_code == 2 and "no config.json" in bad.stderr
    no_routing = run_cli(["inspect-batch", str(path), "--model", str(moe_dir), "--replay-routing"])
    assert no_routing.exit_code == 2 and "carries no routed_experts" in no_routing.stderr


@pytest.mark.slow
def test_a_run_directory_uses_its_newest_checkpoint(tiny_checkpoint, tmp_path):
    """The issue's command: a short run with dumped rollouts, then the per-token view of
    step 3's rollouts with the run's newest checkpoint."""
    train = run_cli(short_gsm8k_args(tiny_checkpoint, tmp_path, 3, "--dump-rollouts"))
    assert train.exit_code == 0, train.output
    run, dump = tmp_path / "t", tmp_path / "t" / "rollouts" / "step_000003.jsonl"
    got = inspect_json(dump, run, "--limit", "2")
    assert got["model"]["step"] == 3 and got["model"]["path"].endswith("step_000003")
    assert len(got["samples"]) == 2
    for s in got["samples"]:
        assert len(s["trainer_logprobs"]) == len(s["rollout_logprobs"]) == len(s["positions"])
    rich = run_cli(
        ["inspect-batch", str(dump), "--model", str(run), "--limit", "2"],
    )
    assert rich.exit_code == 0 and "(step 3)" in rich.stdout
