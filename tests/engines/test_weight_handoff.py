"""The weight hand-off shared by the vLLM and server engines: the safetensors file (tied
weights, views, atomic write) and ``PendingWeights`` (apply now, or at a pause point)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rltool.engines import weight_handoff
from rltool.engines.weight_handoff import PendingWeights, write_weights_file


def _tied_state() -> dict[str, torch.Tensor]:
    emb = torch.arange(6.0).reshape(2, 3)
    return {"embed.weight": emb, "lm_head.weight": emb, "w": torch.ones(3, 2).t()}


def test_drop_tied_writes_one_tensor_per_storage_as_contiguous_cpu_tensors(tmp_path):
    path = write_weights_file(_tied_state(), tmp_path / "w.safetensors", drop_tied=True)
    out = load_file(str(path))
    assert list(out) == ["embed.weight", "w"]  # the tied head is the embedding
    assert torch.equal(out["embed.weight"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(out["w"], torch.ones(2, 3))


def test_without_drop_tied_a_tied_head_is_saved_as_a_copy(tmp_path):
    path = write_weights_file(_tied_state(), tmp_path / "w.safetensors")
    out = load_file(str(path))
    assert sorted(out) == ["embed.weight", "lm_head.weight", "w"]
    assert torch.equal(out["lm_head.weight"], torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("drop_tied", [True, False])
def test_distinct_views_of_one_storage_are_all_kept(tmp_path, drop_tied):
    fused = torch.arange(8.0)  # q and k: two halves of one buffer, not aliases
    state = {"q": fused[:4], "k": fused[4:]}
    out = load_file(str(write_weights_file(state, tmp_path / "w.safetensors", drop_tied)))
    assert torch.equal(out["q"], torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert torch.equal(out["k"], torch.tensor([4.0, 5.0, 6.0, 7.0]))


def test_a_failed_write_leaves_neither_the_file_nor_a_temporary_one(tmp_path, monkeypatch):
    def half_then_fail(tensors, filename):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(weight_handoff, "save_file", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_weights_file(_tied_state(), tmp_path / "w.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_rewrite_of_the_same_path_replaces_it_whole(tmp_path):
    path = tmp_path / "w.safetensors"
    write_weights_file({"a": torch.zeros(2)}, path)
    write_weights_file({"a": torch.ones(2)}, path)
    assert torch.equal(load_file(str(path))["a"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


class _Engine:
    """Records what ``PendingWeights`` calls, in order."""

    def __init__(self, fail: bool = False):
        self.events: list[str] = []
        self.fail = fail

    def apply(self, path: Path, step: int) -> None:
        if self.fail:
            raise RuntimeError("server down")
        self.events.append(f"apply {path.name} {step}")


def _file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_bytes(b"w")
    return path


def test_weights_offered_while_idle_are_applied_at_once(tmp_path):
    engine = _Engine()
    weights = PendingWeights(engine.apply, "E", step=2)
    weights.offer(_file(tmp_path, "a"), 3)
    assert engine.events == ["apply a 3"]
    assert weights.step == 3 and not weights.waiting


def test_during_generate_the_latest_weights_wait_for_the_pause_point(tmp_path):
    engine = _Engine()
    weights = PendingWeights(engine.apply, "E")
    with weights.generating():
        weights.offer(_file(tmp_path, "a"), 1)
        weights.offer(_file(tmp_path, "b"), 2)  # replaces a, which is deleted unapplied
        assert engine.events == [] and weights.waiting and weights.step == 0
        assert not (tmp_path / "a").exists()
        weights.apply_waiting()
        assert engine.events == ["apply b 2"] and weights.step == 2
        weights.offer(_file(tmp_path, "c"), 2)  # the same step again is allowed
    assert engine.events == ["apply b 2", "apply c 2"]  # the call's end applies c
    assert not weights.waiting


def test_the_hooks_run_after_the_applies_around_a_generate(tmp_path):
    engine = _Engine()
    weights = PendingWeights(engine.apply, "E")
    with weights.generating():
        weights.offer(_file(tmp_path, "a"), 1)
    start = lambda: engine.events.append("start")  # noqa: E731
    end = lambda: engine.events.append("end")  # noqa: E731
    engine.events.clear()
    with weights.generating(start=start, end=end):
        weights.offer(_file(tmp_path, "b"), 2)
    assert engine.events == ["start", "apply b 2", "end"]


def test_weights_older_than_those_held_or_waiting_are_refused(tmp_path):
    weights = PendingWeights(_Engine().apply, "E", step=4)
    with pytest.raises(ValueError, match=r"load_weights\(3\) goes back from step 4"):
        weights.check(3)
    with weights.generating():
        weights.offer(_file(tmp_path, "a"), 6)
        late = _file(tmp_path, "b")
        with pytest.raises(ValueError, match=r"load_weights\(5\) goes back from step 6"):
            weights.offer(late, 5)
        assert not late.exists() and (tmp_path / "a").exists()
    assert weights.step == 6


def test_one_generate_at_a_time(tmp_path):
    weights = PendingWeights(_Engine().apply, "VLLMEngine")
    with (
        weights.generating(),
        pytest.raises(RuntimeError, match=r"VLLMEngine.generate is already running"),
        weights.generating(),
    ):
        pytest.fail("a second generate ran")
    with weights.generating():  # the refused call left the first one's state alone
        pass


def test_a_failed_apply_keeps_the_weights_waiting(tmp_path):
    engine = _Engine(fail=True)
    weights = PendingWeights(engine.apply, "E")
    with pytest.raises(RuntimeError, match="server down"):
        weights.offer(_file(tmp_path, "a"), 1)
    assert weights.waiting and weights.step == 0
    engine.fail = False
    weights.apply_waiting()
    assert engine.events == ["apply a 1"] and weights.step == 1


def test_a_failed_apply_before_a_generate_does_not_block_the_next_one(tmp_path):
    engine = _Engine(fail=True)
    weights = PendingWeights(engine.apply, "E")
    with pytest.raises(RuntimeError, match="server down"):
        weights.offer(_file(tmp_path, "a"), 1)
    with pytest.raises(RuntimeError, match="server down"), weights.generating():
        pytest.fail("the generate ran without its weights")
    engine.fail = False
    with weights.generating():
        assert engine.events == ["apply a 1"] and weights.step == 1
