"""A save that runs out of disk space: a clear error naming the path and the free space,
the partial directory removed, the earlier checkpoints kept (app/checkpoint.py). The
writers are made to fail as they do on a full disk; tests/app/test_disk_full_run.py fills
a real tmpfs."""

from __future__ import annotations

import errno

import pytest
from checkpoint_parts import FakeTokenizer, tiny_qwen

from rltool.app import checkpoint as ckpt_mod
from rltool.app.checkpoint import (
    DiskFullError,
    TrainerState,
    capture_rng,
    latest_checkpoint,
    remove_partial_saves,
    save_checkpoint,
)

# what torch.save raises when its stream writer hits a full disk (torch 2.13)
TORCH_FULL = (
    "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
    "data/0: file write failed"
)

SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def _state(step: int) -> TrainerState:
    return TrainerState(step, {}, {}, capture_rng(), {}, {})


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(TORCH_FULL),
        OSError(errno.ENOSPC, "No space left on device"),
        Exception(SAFETENSORS_FULL),  # safetensors' SafetensorError derives from Exception
    ],
    ids=["torch-enforce", "enospc", "safetensors"],
)
def test_a_full_disk_names_path_and_free_space_and_removes_the_partial_save(
    tmp_path, monkeypatch, error
):
    root = tmp_path / "run" / "checkpoints"
    model = tiny_qwen()
    first = save_checkpoint(root, model, FakeTokenizer(), _state(1))

    def full(obj, path, *args, **kwargs):
        path.write_bytes(b"\0" * 1000)  # the part written before the disk filled up
        raise error

    monkeypatch.setattr(ckpt_mod.torch, "save", full)
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda p: _Usage(free=3 * 2**20 // 2))
    with pytest.raises(DiskFullError) as caught:
        save_checkpoint(root, model, FakeTokenizer(), _state(2))
    message = str(caught.value)
    assert f"no space left on the device of {root} to save a checkpoint: 1.5 MiB free" in message
    assert "the newest checkpoint, step_000001, takes" in message
    assert "step_000001 and older checkpoints stay" in message
    assert f"continue with: rltool train --resume {root.parent}" in message
    assert not (root / ".tmp-step_000002").exists()
    assert latest_checkpoint(root.parent) == first


def test_other_write_errors_still_remove_the_partial_save_and_pass_through(tmp_path, monkeypatch):
    root = tmp_path / "run" / "checkpoints"

    def denied(obj, path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(ckpt_mod.torch, "save", denied)
    with pytest.raises(PermissionError):
        save_checkpoint(root, tiny_qwen(), FakeTokenizer(), _state(1))
    assert not (root / ".tmp-step_000001").exists()


def test_partial_saves_are_removed_and_complete_ones_kept(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    kept = save_checkpoint(root, tiny_qwen(), FakeTokenizer(), _state(1))
    (root / ".tmp-step_000002" / "sharded").mkdir(parents=True)
    (root / ".tmp-step_000002" / "model.safetensors").write_bytes(b"\0" * 10)
    assert [p.name for p in remove_partial_saves(root.parent)] == [".tmp-step_000002"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert latest_checkpoint(root.parent) == kept


class _Usage:
    def __init__(self, free: int) -> None:
        self.total, self.used, self.free = 2 * free, free, free
