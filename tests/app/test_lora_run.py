"""LoRA through a real run on a tiny checkpoint: the base stays bit-identical, the rollout
engine sees base + adapters (merged weights, copied in at each sync), the KL
reference is the base, checkpoints hold adapters, resume and `rltool export` work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from short_runs import GSM8K_TINY, short_gsm8k_args

from rltool.app.run import build_run, generate_step
from rltool.config.loader import load_recipe
from rltool.config.schema import LoraConfig
from rltool.lora import ADAPTER_WEIGHTS, apply_lora, load_checkpoint_weights
from rltool.models import load_model_and_tokenizer

LORA = ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8")


def _recipe(ckpt: Path, tmp_path: Path, *extra: str):
    args = short_gsm8k_args(ckpt, tmp_path, 1, *LORA, "optimizer.lr=0.05", *extra)
    overrides = [a for a in args[2:] if "=" in a]
    return load_recipe(GSM8K_TINY, overrides)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(0))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits
    model.train(was)
    return out


def _train_two_steps(run) -> list[dict[str, float]]:
    metrics = []
    for step in (1, 2):
        metrics.append(run.controller.fit(generate_step(run), train_step=step).metrics)
        run.step = step
        run.producer.update_weights(run.model, step)
    return metrics


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_adapters_train_base_stays_bit_identical_engine_sees_the_policy(
    tiny_checkpoint, tmp_path, mode
):
    """sync: the HF engine handed the shared model generates on a plain merged copy that
    each sync refreshes; async: its own copy receives merged weights under the base names
    through load_weights. kl_coef > 0 runs the
    reference (the policy with adapters off) in the updater. The random model earns no
    reward, so an entropy bonus gives the adapters a gradient."""
    recipe = _recipe(
        tiny_checkpoint,
        tmp_path,
        f"produce.mode={mode}",
        "algorithm.kl_coef=0.1",
        "algorithm.entropy_coef=0.1",
    )
    run = build_run(recipe)
    try:
        base = {k: v.clone() for k, v in run.model.state_dict().items() if ".lora_" not in k}
        lora_b = {k: v.clone() for k, v in run.model.state_dict().items() if ".lora_B." in k}
        assert lora_b and all(not v.any() for v in lora_b.values())  # adapters start at 0
        assert run.controller.updater.ref_model is not None
        metrics = _train_two_steps(run)
        assert all(m["actor/kl"] >= 0 and m["actor/optimizer_steps"] == 1 for m in metrics)
        assert metrics[1]["actor/kl"] > 0  # step 2 scores the adapters against the base
        after = run.model.state_dict()
        assert all(torch.equal(base[k], after[k]) for k in base)  # every base weight
        assert any(after[k].any() for k in lora_b)  # the adapters moved
        engine = run.producer.backend.worker.engine
        assert engine.model_step == 2
        ids = _ids(run.model.config.vocab_size)
        # sync: a plain merged copy that sync_weights refreshed; async: load_weights
        assert ".lora_" not in " ".join(engine.model.state_dict())  # plain names
        torch.testing.assert_close(
            _logits(engine.model, ids), _logits(run.model, ids), atol=1e-5, rtol=0
        )
    finally:
        run.close()


def test_checkpoint_resume_and_merged_export(tiny_checkpoint, tmp_path):
    # the random model earns no reward: an entropy bonus moves the adapters
    args = short_gsm8k_args(
        tiny_checkpoint, tmp_path, 2, *LORA, "optimizer.lr=0.05", "algorithm.entropy_coef=0.1"
    )
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "t"
    ckpt = run_dir / "checkpoints" / "step_000002"
    files = set(json.loads((ckpt / "manifest.json").read_text())["files"])
    assert {ADAPTER_WEIGHTS, "adapter_config.json", "trainer_state.pt"} <= files
    assert "model.safetensors" not in files  # adapters only, not the full model

    resumed = run_cli(["train", "--resume", str(run_dir), "trainer.steps=3"])
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from" in resumed.output
    assert (run_dir / "checkpoints" / "step_000003" / ADAPTER_WEIGHTS).is_file()

    evaluated = run_cli(["eval", str(run_dir), "data.eval_limit=2", "--format", "json"])
    assert evaluated.exit_code == 0, evaluated.output  # the adapters load for rltool eval
    assert json.loads(evaluated.output[evaluated.output.index("{") :])["step"] == 3

    out = tmp_path / "merged"
    exported = run_cli(["export", str(run_dir), str(out)])
    assert exported.exit_code == 0, exported.output
    assert "LoRA adapters, merged" in exported.output
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    recipe = load_recipe(run_dir / "config.yaml", [f"model.path={out}"])
    recipe.model.lora.enabled = False
    merged, _, _ = load_model_and_tokenizer(recipe.model)  # any model.path loads it
    base_recipe = load_recipe(run_dir / "config.yaml")
    base, _, _ = load_model_and_tokenizer(base_recipe.model)
    ids = _ids(base.config.vocab_size)
    base_logits = _logits(base, ids)
    policy = apply_lora(base, LoraConfig(rank=4, alpha=8))
    load_checkpoint_weights(policy, run_dir / "checkpoints" / "step_000003")
    torch.testing.assert_close(_logits(merged, ids), _logits(policy, ids), atol=1e-5, rtol=0)
    assert (_logits(merged, ids) - base_logits).abs().max() > 1e-4  # the adapters trained

    again = run_cli(["export", str(run_dir), str(out)])
    assert again.exit_code == 2 and "not an empty directory" in again.output


def test_lora_with_warm_start_moments_is_refused(tiny_checkpoint, tmp_path):
    args = short_gsm8k_args(
        tiny_checkpoint, tmp_path, 1, *LORA, "optimizer.init_from_checkpoint=true"
    )
    result = run_cli(args)
    assert result.exit_code != 0
    assert "optimizer.init_from_checkpoint" in result.output
