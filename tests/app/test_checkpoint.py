"""Atomic checkpoints and the resumable prompt order."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch
from checkpoint_parts import FakeTokenizer, tiny_qwen

from rltool.app import checkpoint as ckpt_mod
from rltool.app.checkpoint import (
    NoCheckpointError,
    TrainerState,
    capture_rng,
    latest_checkpoint,
    load_trainer_state,
    open_checkpoint,
    restore_rng,
    save_checkpoint,
    verify_checkpoint,
)
from rltool.produce.sampler import PromptSampler


def _state(step: int) -> TrainerState:
    producer = {"sampler": {"epoch": 0}}
    return TrainerState(step, {"opt": step}, {"sched": step}, capture_rng(), {}, producer)


def test_save_then_load_roundtrip(tmp_path):
    model = tiny_qwen()
    path = save_checkpoint(tmp_path, model, FakeTokenizer(), _state(3))
    assert path.name == "step_000003"
    assert (path / "model.safetensors").is_file()
    state = load_trainer_state(path)
    assert state.step == 3 and state.optimizer == {"opt": 3}


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    model = tiny_qwen()
    save_checkpoint(root, model, FakeTokenizer(), _state(1))

    real_save = torch.save

    def crash(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(ckpt_mod.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, model, FakeTokenizer(), _state(2))
    monkeypatch.undo()
    assert not (root / ".tmp-step_000002" / "manifest.json").exists()

    latest = latest_checkpoint(run_dir)
    assert latest.name == "step_000001"
    assert load_trainer_state(latest).step == 1
    assert not (root / "step_000002").exists()
    # the next save cleans the half-written directory and moves latest on
    save_checkpoint(root, model, FakeTokenizer(), _state(2))
    assert latest_checkpoint(run_dir).name == "step_000002"
    assert not (root / ".tmp-step_000002").exists()


def test_keep_last_prunes_old_checkpoints(tmp_path):
    model = tiny_qwen()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, model, FakeTokenizer(), _state(step), keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003"]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(NoCheckpointError, match="no complete checkpoint to resume from in") as e:
        latest_checkpoint(tmp_path)
    assert str(tmp_path) in str(e.value)


def _two_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    model = tiny_qwen()
    for step in (1, 2):
        save_checkpoint(run_dir / "checkpoints", model, FakeTokenizer(), _state(step))
    return run_dir, run_dir / "checkpoints" / "step_000002"


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    _, newest = _two_checkpoints(tmp_path)
    files = json.loads((newest / "manifest.json").read_text())["files"]
    assert sorted(files) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "trainer_state.pt",
    ]
    state = files["trainer_state.pt"]
    data = (newest / "trainer_state.pt").read_bytes()
    assert state == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(newest) is None


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:100])
    return f"model.safetensors size 100 != {len(data)} in the manifest"


def _random_bytes_in_place(path):
    size = path.stat().st_size
    path.write_bytes(random.Random(0).randbytes(size))  # same size: only the checksum sees it
    return "trainer_state.pt sha256 differs from the manifest (bytes changed in place)"


def _missing(path):
    path.unlink()
    return "model.safetensors is missing"


def _no_manifest(path):
    path.unlink()
    return "no manifest.json (the save did not finish)"


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("model.safetensors", _truncate),
        ("trainer_state.pt", _random_bytes_in_place),
        ("model.safetensors", _missing),
        ("manifest.json", _no_manifest),
    ],
)
def test_damaged_newest_checkpoint_is_skipped_with_the_reason(tmp_path, name, damage):
    run_dir, newest = _two_checkpoints(tmp_path)
    reason = damage(newest / name)
    found = open_checkpoint(run_dir)
    assert found.path.name == "step_000001" and found.state.step == 1
    assert found.skipped == [f"step_000002: {reason}"]


def test_checkpoint_that_does_not_load_is_skipped(tmp_path):
    run_dir, newest = _two_checkpoints(tmp_path)

    def load_weights(ckpt):
        if ckpt == newest:
            raise RuntimeError("Error(s) in loading state_dict: missing key lm_head")

    found = open_checkpoint(run_dir, load_weights)
    assert found.path.name == "step_000001"
    assert found.skipped == [
        "step_000002: does not load (RuntimeError: Error(s) in loading state_dict: "
        "missing key lm_head)"
    ]


def test_missing_latest_pointer_is_recovered_by_scanning(tmp_path):
    run_dir, newest = _two_checkpoints(tmp_path)
    (run_dir / "checkpoints" / "latest").unlink()
    found = open_checkpoint(run_dir)
    assert found.path == newest and found.skipped == []


def test_every_checkpoint_damaged_is_a_clear_error_naming_each(tmp_path):
    run_dir, newest = _two_checkpoints(tmp_path)
    _missing(newest / "model.safetensors")
    _truncate(run_dir / "checkpoints" / "step_000001" / "model.safetensors")
    with pytest.raises(NoCheckpointError) as e:
        open_checkpoint(run_dir)
    msg = str(e.value)
    assert msg.startswith(f"no complete checkpoint to resume from in {run_dir} (")
    assert (
        "step_000002: model.safetensors is missing; step_000001: model.safetensors size 100" in msg
    )


def test_rng_roundtrip():
    state = capture_rng()
    a = torch.rand(3)
    restore_rng(state)
    assert torch.equal(torch.rand(3), a)


def test_sampler_resumes_at_the_same_position():
    full = PromptSampler(10, seed=7)
    expected = [full.take(4) for _ in range(5)]  # crosses two epoch boundaries

    first = PromptSampler(10, seed=7)
    got = [first.take(4) for _ in range(2)]
    resumed = PromptSampler(10, seed=7)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.take(4) for _ in range(3)]
    assert got == expected
    flat = [i for chunk in expected for i in chunk]
    assert sorted(flat[:10]) == list(range(10))  # an epoch visits every example once
    assert flat[:10] != flat[10:20]  # and the next epoch is reshuffled


def test_sampler_refuses_other_data_size():
    s = PromptSampler(10, seed=0)
    with pytest.raises(ValueError, match="same data files"):
        PromptSampler(11, seed=0).load_state_dict(s.state_dict())
