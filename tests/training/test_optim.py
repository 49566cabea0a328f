"""AdamW + LambdaLR: the schedule by hand, warm-start moments, exact resume."""

from __future__ import annotations

import math

import pytest
import torch

from rltool.config.schema import OptimizerConfig
from rltool.training.optim import (
    build_optimizer,
    build_scheduler,
    load_moments,
    lr_multiplier,
    save_moments,
)


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # warmup 2 of 6 steps, min_lr_ratio 0.1; decay progress 0, 1/4, 1/2, 3/4 from step 2
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.775, 0.55, 0.325]),
        (
            "cosine",
            [
                0.5,
                1.0,
                1.0,
                0.1 + 0.45 * (1 + math.cos(math.pi / 4)),
                0.55,
                0.1 + 0.45 * (1 - math.cos(math.pi / 4)),
            ],
        ),
    ],
)
def test_lr_multiplier_hand_worked(schedule: str, expected: list[float]) -> None:
    got = [lr_multiplier(s, 2, 6, schedule, 0.1) for s in range(6)]
    assert got == pytest.approx(expected, abs=1e-9)


def test_schedule_clamps_after_the_end_and_without_warmup_starts_at_full_lr() -> None:
    assert lr_multiplier(0, 0, 10, "cosine", 0.0) == 1.0
    assert lr_multiplier(25, 0, 10, "linear", 0.2) == pytest.approx(0.2)


def test_scheduler_steps_the_optimizer_lr() -> None:
    model = torch.nn.Linear(3, 2)
    cfg = OptimizerConfig(lr=0.1, warmup_steps=2, schedule="linear", min_lr_ratio=0.1)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: a no-op, keeps torch's step order
        sched.step()
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.0775, 0.055, 0.0325], abs=1e-12)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, steps: int) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(4, 3, generator=g)
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_state_dicts_resume_exactly() -> None:
    cfg = OptimizerConfig(lr=0.05, warmup_steps=1, schedule="cosine", weight_decay=0.01)
    torch.manual_seed(0)
    a = torch.nn.Linear(3, 2)
    b = torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = build_optimizer(a, cfg), build_optimizer(b, cfg)
    sched_a = build_scheduler(opt_a, cfg, 5)
    sched_b = build_scheduler(opt_b, cfg, 5)
    _train(a, opt_a, sched_a, 2)
    _train(b, opt_b, sched_b, 2)
    resumed = torch.nn.Linear(3, 2)
    resumed.load_state_dict(b.state_dict())
    opt_r = build_optimizer(resumed, cfg)
    sched_r = build_scheduler(opt_r, cfg, 5)
    opt_r.load_state_dict(opt_b.state_dict())
    sched_r.load_state_dict(sched_b.state_dict())
    _train(a, opt_a, sched_a, 2)
    _train(resumed, opt_r, sched_r, 2)
    assert opt_r.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    for p, q in zip(a.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)  # the same updates on the same shapes from exact copies


def test_warm_start_takes_moments_but_keeps_recipe_hyperparameters(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    warm = build_optimizer(model, OptimizerConfig(lr=0.3, betas=(0.8, 0.9)))
    model(torch.ones(1, 3)).sum().backward()
    warm.step()
    save_moments(warm, tmp_path)
    cfg = OptimizerConfig(lr=0.01)
    opt = build_optimizer(model, cfg, init_dir=tmp_path)
    assert opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    for p in model.parameters():
        assert torch.equal(opt.state[p]["exp_avg"], warm.state[p]["exp_avg"])
        assert float(opt.state[p]["step"]) == 1.0
    sched = build_scheduler(opt, cfg, 3)
    assert opt.param_groups[0]["lr"] == 0.01 and sched.base_lrs == [0.01]


def test_warm_start_from_another_model_is_a_clear_error(tmp_path) -> None:
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    save_moments(build_optimizer(other, OptimizerConfig()), tmp_path)
    with pytest.raises(ValueError, match="another model"):
        load_moments(
            build_optimizer(torch.nn.Linear(3, 2), OptimizerConfig()), tmp_path / "optimizer.pt"
        )
    with pytest.raises(FileNotFoundError, match="init_from_checkpoint"):
        build_optimizer(torch.nn.Linear(3, 2), OptimizerConfig(), init_dir=tmp_path / "none")
