"""`rltool train` with a hub id as model.path (from a cache the test builds) and W&B in
offline mode as a tracker: the run loads the cached model and W&B records its lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from hub_and_wandb import build_hub_cache, read_wandb_log, wandb_key
from short_runs import short_gsm8k_args


@pytest.mark.slow
def test_train_from_a_cached_hub_id_with_wandb_offline(tiny_checkpoint, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    cache = tmp_path / "hf"
    build_hub_cache(cache, "tiny-org/tiny-model", tiny_checkpoint)
    for key, value in {
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
    }.items():
        monkeypatch.setenv(key, value)
    args = short_gsm8k_args(
        Path("tiny-org/tiny-model"), tmp_path / "runs", 2, "logging.trackers=[wandb]"
    )
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    wandb.teardown()  # flushes the run log

    run_dir = tmp_path / "runs" / "t"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = [r.history for r in read_wandb_log(log) if r.WhichOneof("record_type") == "history"]
    logged = [{wandb_key(i): json.loads(i.value_json) for i in h.item} for h in history]
    steps = [x["step"] for x in lines]
    assert steps == [0, 1, 2, 2]  # eval, train, train, eval
    # W&B keeps one row per step: the train and eval lines of step 2 share one
    assert [h.step.num for h in history] == [0, 1, 2]
    for step, got in zip([0, 1, 2], logged, strict=True):
        expected = {
            k: v
            for line in lines
            if line["step"] == step
            for k, v in line.items()
            if k not in ("step", "kind") and v is not None
        }
        assert {k: v for k, v in got.items() if not k.startswith("_")} == expected
