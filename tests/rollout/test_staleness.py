"""Token staleness (data-contract section 6) with hand-worked thresholds and masks."""

from __future__ import annotations

from rltool.config.schema import AlgorithmConfig
from rltool.rollout.contract import check_sample, errors
from rltool.rollout.staleness import StalenessLimits, bake_staleness, token_staleness
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status

X = IGNORE_INDEX


Limits = StalenessLimits


def _sample(steps: list[int] | None = None) -> RolloutState:
    """P = 2, R = 5; response token 31 is tool output (label -100)."""
    prompt, response = [1, 2], [30, 31, 32, 33, 34]
    return RolloutState(
        rollout_id="r0",
        group_id="g",
        prompt_ids=prompt,
        response_ids=response,
        input_ids=prompt + response,
        labels=[X, X, 30, X, 32, 33, 34],
        logprobs=[0.0, 0.0, -0.1, 0.0, -0.2, -0.3, -0.4],
        response_model_steps=steps,
        reward={"score": 1.0},
        status=Status.COMPLETED,
    )


def test_token_staleness() -> None:
    assert token_staleness(5, [1, 2, 4]).tolist() == [3, 2, 0]  # 5 - step - 1
    assert token_staleness(3, [2, 2]).tolist() == [0, 0]  # synchronous: trained right after


def test_thresholds() -> None:
    cfg = Limits(max_staleness=2, max_token_staleness=1, sync_interval=2)
    assert cfg.token_threshold == (1 + 1) * 2 == 4
    assert cfg.sample_threshold == (2 + 1) * 2 == 6
    assert Limits().token_threshold is None and Limits().sample_threshold is None
    from_recipe = Limits.from_algorithm(AlgorithmConfig(max_token_staleness=0))
    assert from_recipe.token_threshold == 1  # the recipe section's values


def test_bake_clears_stale_tokens_in_place() -> None:
    # train step 5, steps [0, 0, 1, 3, 3] -> staleness [4, 4, 3, 1, 1]
    # max_token_staleness 1, sync_interval 2 -> trainable while staleness < 4
    s = _sample(steps=[0, 0, 1, 3, 3])
    labels, logprobs = s.labels, s.logprobs
    r = bake_staleness(s, 5, Limits(max_token_staleness=1, sync_interval=2))
    # response 0 (staleness 4) is cleared; response 1 (also 4) was tool output already
    assert s.labels.tolist() == [X, X, X, X, 32, 33, 34]
    assert s.labels is labels and s.logprobs is logprobs  # the sample's own arrays, in place
    assert s.logprobs.tolist() == [0.0, 0.0, 0.0, 0.0, -0.2, -0.3, -0.4]
    assert (r.cleared, r.max_staleness, r.expired, r.reason) == (1, 4, False, None)
    assert not errors(check_sample(s))  # still a valid sample


def test_bake_boundary_is_strict() -> None:
    # staleness 3 is trainable under threshold 4, staleness 4 is not
    s = _sample(steps=[1, 1, 1, 1, 1])  # train step 5 -> staleness 3 everywhere
    assert bake_staleness(s, 5, Limits(max_token_staleness=1, sync_interval=2)).cleared == 0
    assert bake_staleness(s, 6, Limits(max_token_staleness=1, sync_interval=2)).cleared == 4


def test_bake_twice_gives_identical_labels() -> None:
    s = _sample(steps=[0, 0, 1, 3, 3])
    cfg = Limits(max_token_staleness=1, sync_interval=2)
    bake_staleness(s, 5, cfg)
    once = (s.labels.tolist(), s.logprobs.tolist())
    again = bake_staleness(s, 5, cfg)
    assert (s.labels.tolist(), s.logprobs.tolist()) == once
    assert again.cleared == 0


def test_expiry_by_oldest_token() -> None:
    # max_staleness 1, sync_interval 2 -> expires when the oldest token reaches 4
    cfg = Limits(max_staleness=1, sync_interval=2)
    r = bake_staleness(_sample(steps=[0, 0, 1, 3, 3]), 5, cfg)
    assert (r.expired, r.reason, r.max_staleness, r.cleared) == (True, "max_staleness", 4, 0)
    r = bake_staleness(_sample(steps=[1, 1, 1, 3, 3]), 5, cfg)  # oldest 3 < 4
    assert not r.expired


def test_expiry_when_no_supervised_token_is_left() -> None:
    s = _sample(steps=[0, 0, 0, 0, 0])  # staleness 4 everywhere at step 5
    r = bake_staleness(s, 5, Limits(max_token_staleness=0, sync_interval=1))  # threshold 1
    assert s.labels.tolist() == [X] * 7
    assert (r.cleared, r.expired, r.reason) == (4, True, "no_supervised_tokens")


def test_no_model_steps_is_never_stale() -> None:
    s = _sample(steps=None)
    before = s.labels.tolist()
    r = bake_staleness(s, 1000, Limits(max_staleness=0, max_token_staleness=0))
    assert s.labels.tolist() == before
    assert (r.cleared, r.expired) == (0, False)


def test_no_limits_changes_nothing() -> None:
    s = _sample(steps=[0, 0, 1, 3, 3])
    r = bake_staleness(s, 5, Limits())
    assert s.labels.tolist() == [X, X, 30, X, 32, 33, 34]
    assert (r.cleared, r.max_staleness, r.expired) == (0, 4, False)
