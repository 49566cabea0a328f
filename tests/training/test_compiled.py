"""``trainer.compile: layers``: the train step's forwards run compiled decoder layers; eager is
the reference (loss and gradients), generation keeps the eager layers, and the recipe's
value is checked when it loads."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_updater import VOCAB, laid_out, make_samples, pack_of
from tiny_models import random_qwen2

from rltool.config.checks import NAMES
from rltool.config.loader import load_recipe
from rltool.config.schema import AlgorithmConfig, OptimizerConfig
from rltool.training.compiled import COMPILE_MODES, CompiledLayers, decoder_layers
from rltool.training.optim import build_scheduler
from rltool.training.updater import PolicyUpdater

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k_tiny.yaml"


def test_the_recipe_names_are_the_modes() -> None:
    assert NAMES["trainer.compile"].known() == list(COMPILE_MODES)


def test_an_unknown_mode_names_the_key_and_the_modes() -> None:
    with pytest.raises(ValueError) as err:
        load_recipe(RECIPE, ["trainer.compile=fast"])
    assert (
        str(err.value) == f"recipe {RECIPE}: trainer.compile = 'fast': must be one of: off, layers"
    )


def test_compile_with_activation_checkpointing_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        load_recipe(RECIPE, ["trainer.compile=layers", "distributed.activation_checkpointing=true"])
    assert str(err.value) == (
        f"recipe {RECIPE}: trainer.compile = 'layers' with "
        "distributed.activation_checkpointing = true: a checkpointed layer recomputes its "
        "forward eagerly in the backward, which does not match the compiled forward; set "
        "trainer.compile: off or distributed.activation_checkpointing: false"
    )
    assert load_recipe(RECIPE, ["trainer.compile=layers"]).trainer.compile == "layers"


def test_a_model_without_decoder_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="Linear has no transformers decoder layers"):
        CompiledLayers(torch.nn.Linear(2, 2))


def sgd_updater(model: torch.nn.Module, compile: str) -> PolicyUpdater:
    """Plain SGD at lr 1: a step moves each weight by minus its gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = build_scheduler(opt, OptimizerConfig(), 10)
    return PolicyUpdater(model, opt, sched, AlgorithmConfig(), compile=compile)


@pytest.mark.slow
def test_compiled_step_equals_eager() -> None:
    """Two steps on shared-prefix rows (causal prefix pieces, masked branch pieces) of
    different lengths (dynamic shapes): the same loss, and the same gradients (SGD at lr 1
    turns each into the weights' change), to float32 rounding."""
    layout = "shared"
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    eager = random_qwen2(VOCAB)
    compiled = copy.deepcopy(eager)
    steps = [
        laid_out([pack_of(make_samples([1.0, -1.0, 0.5], seed=1), [0, 1, 2])], layout),
        laid_out([pack_of(make_samples([1.0, -0.5], seed=3), [0, 1])], layout),
    ]
    assert len(steps[0][0]) != len(steps[1][0])
    a, b = sgd_updater(eager, "off"), sgd_updater(compiled, "layers")
    for packs in steps:
        before = [p.detach().clone() for p in compiled.parameters()]
        ma, mb = a.step(packs), b.step(packs)
        assert mb["actor/pg_loss"] == pytest.approx(ma["actor/pg_loss"], abs=1e-6)
        assert mb["actor/grad_norm"] == pytest.approx(ma["actor/grad_norm"], rel=1e-5)
        grads = [
            (p0 - p).abs().max().item() for p0, p in zip(before, compiled.parameters(), strict=True)
        ]
        assert max(grads) > 1e-4  # the step moved the weights: the comparison below can fail
        for pa, pb in zip(eager.parameters(), compiled.parameters(), strict=True):
            torch.testing.assert_close(pb, pa, atol=1e-5, rtol=1e-5)
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames  # compiled frames ran
    # outside the step the layers are eager again: generation never sees the compiled ones
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(compiled))
