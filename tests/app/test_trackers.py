"""logging.trackers: names and packages checked before the model loads; W&B in offline mode."""

from __future__ import annotations

import importlib.util
import json

import pytest
from hub_and_wandb import read_wandb_log, wandb_key

from rltool.app.metrics_log import MetricsWriter
from rltool.app.trackers import check_trackers, open_trackers, tracker_names
from rltool.config.loader import load_recipe
from rltool.config.schema import LoggingConfig, RecipeConfig


def test_tensorboard_flag_is_an_alias_of_the_list():
    assert tracker_names(LoggingConfig()) == []
    assert tracker_names(LoggingConfig(tensorboard=True)) == ["tensorboard"]
    both = LoggingConfig(trackers=["wandb", "tensorboard"], tensorboard=True)
    assert tracker_names(both) == ["wandb", "tensorboard"]


def test_unknown_tracker_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"logging\.trackers: unknown tracker 'mlflow'.*"):
        check_trackers(LoggingConfig(trackers=["mlflow"]))
    with pytest.raises(ValueError, match="known: tensorboard, wandb"):
        check_trackers(LoggingConfig(trackers=["mlflow"]))


def test_missing_package_says_which_extra_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ValueError) as err:
        check_trackers(LoggingConfig(trackers=["wandb"]))
    assert str(err.value) == (
        "logging.trackers: wandb needs the wandb package: pip install 'rltool[wandb]'"
    )


def test_trackers_come_from_a_recipe_override(tmp_path):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("logging:\n  name: mine\n")
    recipe = load_recipe(recipe_file, ["logging.trackers=[wandb]"])
    assert recipe.logging.trackers == ["wandb"]


def test_wandb_offline_run_records_the_metrics_and_the_recipe(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # in the dev extra; an install without it skips
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    recipe = RecipeConfig()
    recipe.logging.trackers = ["wandb"]
    recipe.logging.name = "offline-test"
    writer = MetricsWriter(tmp_path, open_trackers(tmp_path, recipe))
    writer.write(0, {"eval/accuracy": 0.25}, kind="eval")
    writer.write(1, {"actor/pg_loss": 0.5, "actor/kl": float("inf")}, kind="train")
    writer.write(2, {"actor/pg_loss": 0.125}, kind="train")
    writer.close()
    import wandb

    wandb.teardown()  # stops wandb's service process, which flushes the run log to disk

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (log,) = runs[0].glob("run-*.wandb")  # what `wandb sync` uploads later
    records = read_wandb_log(log)
    history = [
        {wandb_key(item): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    for line in history:
        del line["_timestamp"], line["_runtime"]
    assert history == [
        {"eval/accuracy": 0.25, "_step": 0},
        {"actor/pg_loss": 0.5, "_step": 1},  # the infinite KL is left out
        {"actor/pg_loss": 0.125, "_step": 2},
    ]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project) == ("offline-test", "rltool")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["path"] == "builtin:tiny-gsm8k"
    assert config["logging"]["trackers"] == ["wandb"]


def test_tensorboard_writes_the_finite_scalars_per_step(tmp_path):
    pytest.importorskip("tensorboard")  # in the dev extra; an install without it skips
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = RecipeConfig()
    recipe.logging.tensorboard = True  # the alias
    writer = MetricsWriter(tmp_path, open_trackers(tmp_path, recipe))
    writer.write(0, {"eval/accuracy": 0.25}, kind="eval")
    writer.write(1, {"actor/pg_loss": 0.5, "actor/kl": float("nan")}, kind="train")
    writer.write(2, {"actor/pg_loss": 0.125}, kind="train")
    writer.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["actor/pg_loss", "eval/accuracy"]
    loss = [(e.step, e.value) for e in events.Scalars("actor/pg_loss")]
    assert loss == [(1, 0.5), (2, 0.125)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, 0.25)]
