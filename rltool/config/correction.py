"""``algorithm.rollout_correction`` resolved: presets, ``tis_cap``, and the form of each
threshold, checked when the recipe loads (the pass ``--print-config`` runs).

The correction itself (weights, rejection masks, mismatch metrics) is
``rltool.training.rollout_correction``; this module only says what a recipe asks for.
Presets mean what verl 0.9.1's ``RolloutCorrectionConfig`` factories of the same idea
set (``decoupled_token_is``, ``decoupled_seq_is``, ``decoupled_seq_is_rs``,
``decoupled_geo_rs``, ``decoupled_k3_rs``, ``decoupled_token_icepop``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rltool.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig

KEY = "algorithm.rollout_correction"
LEVELS = ("token", "sequence")
WEIGHTS = ("", "none", *LEVELS)  # "" = the preset's
# k1 = -log r (r = old / rollout) is bounded on both sides as a ratio [lower, upper]; k2, k3
# are divergences >= 0 bounded above. token_*: each token; seq_sum/seq_mean/seq_max_*:
# each sample's sum, mean or max over its tokens, keeping or dropping the whole sample
CRITERIA = tuple(
    f"{level}_k{k}" for level in ("token", "seq_sum", "seq_mean", "seq_max") for k in (1, 2, 3)
)
DEFAULT_UPPER = 2.0  # verl's default truncation


@dataclass(frozen=True, slots=True)
class Criterion:
    name: str  # one of CRITERIA
    lower: float | None  # k1 only: the lower ratio bound
    upper: float

    @property
    def two_sided(self) -> bool:
        return self.name.endswith("k1")

    @property
    def sequence_level(self) -> bool:
        return not self.name.startswith("token_")


@dataclass(frozen=True, slots=True)
class CorrectionSpec:
    """What the trainer applies between rollout and trainer logprobs."""

    weights: str | None = None  # None | token | sequence
    upper: float = DEFAULT_UPPER  # weights above are set to it (TIS) ...
    lower: float | None = None  # ... or, with a lower bound, outside [lower, upper] -> 0 (IcePop)
    batch_normalize: bool = False
    reject: tuple[Criterion, ...] = field(default_factory=tuple)
    opsm_delta: float | None = None

    @property
    def active(self) -> bool:
        return self.weights is not None or bool(self.reject) or self.opsm_delta is not None


@dataclass(frozen=True, slots=True)
class _Preset:
    weights: str | None = None
    upper: float = DEFAULT_UPPER
    lower: float | None = None
    reject: tuple[Criterion, ...] = ()


PRESETS: dict[str, _Preset] = {
    "token_tis": _Preset("token", 2.0),
    "seq_tis": _Preset("sequence", 2.0),
    "seq_mis": _Preset("sequence", 2.0, reject=(Criterion("seq_sum_k1", 0.5, 2.0),)),
    "geo_rs": _Preset(reject=(Criterion("seq_mean_k1", 0.999, 1.001),)),
    "k3_rs": _Preset(reject=(Criterion("seq_mean_k3", None, 0.01),)),
    "icepop": _Preset("token", 5.0, lower=0.5),
}


def correction_problems(algo: AlgorithmConfig) -> list[str]:
    """One line per bad ``algorithm.rollout_correction`` setting (empty when it resolves):
    its names, then the forms of its thresholds."""
    cfg = algo.rollout_correction
    problems = []
    if cfg.preset and cfg.preset not in PRESETS:
        problems.append(
            f"{KEY}.preset: unknown {cfg.preset!r}; known: {', '.join(PRESETS)} "
            f"(or a mapping of weights, reject, ...)"
        )
    if cfg.weights not in WEIGHTS:
        problems.append(f"{KEY}.weights: unknown {cfg.weights!r}; known: none, token, sequence")
    for i, item in enumerate(cfg.reject):
        if item.criterion not in CRITERIA:
            problems.append(
                f"{KEY}.reject[{i}].criterion: unknown {item.criterion!r}; "
                f"known: {', '.join(CRITERIA)}"
            )
    return problems or form_problems(algo)


def form_problems(algo: AlgorithmConfig) -> list[str]:
    """One line per threshold of the wrong form; the names were checked already (the
    recipe loader checks them with every other name, ``config/checks.py``'s ``NAMES``)."""
    cfg = algo.rollout_correction
    problems = []
    seen: set[str] = set()
    for i, item in enumerate(cfg.reject):
        where = f"{KEY}.reject[{i}]"
        if item.criterion not in CRITERIA:
            continue
        if item.criterion in seen:
            problems.append(f"{where}.criterion: {item.criterion} is listed twice")
        seen.add(item.criterion)
        if item.criterion.endswith("k1"):
            if item.lower is None or item.upper is None:
                problems.append(
                    f"{where}: {item.criterion} bounds the ratio old/rollout on both sides: "
                    f"set lower and upper (e.g. lower: 0.999, upper: 1.001)"
                )
            elif item.lower > item.upper:
                problems.append(f"{where}: lower {item.lower} is above upper {item.upper}")
        else:
            if item.upper is None:
                problems.append(
                    f"{where}: {item.criterion} needs upper (the largest divergence kept, "
                    f"e.g. upper: 0.01)"
                )
            if item.lower is not None:
                problems.append(
                    f"{where}: {item.criterion} is a divergence (>= 0) with an upper bound "
                    f"only; remove lower (two-sided ratio bounds are the *_k1 criteria)"
                )
    if problems:
        return problems
    spec = _build(algo)  # what the preset and tis_cap leave, checked as a whole
    if spec.weights is not None and spec.lower is not None and spec.lower > spec.upper:
        problems.append(
            f"{KEY}: weight_lower {spec.lower} is above the weight upper bound {spec.upper}; "
            f"IcePop keeps weights in [weight_lower, weight_upper]"
        )
    if cfg.batch_normalize and spec.weights is None:
        problems.append(f"{KEY}.batch_normalize: no weights to normalise; set weights")
    return problems


def resolve_correction(algo: AlgorithmConfig) -> CorrectionSpec:
    """The correction a recipe asks for; ValueError listing every bad key.

    A preset fills what ``rollout_correction`` leaves empty; without a preset, weights or
    rejection there, ``tis_cap`` (when set) is ``token_tis`` with that cap."""
    problems = correction_problems(algo)
    if problems:
        raise ValueError("; ".join(problems))
    return _build(algo)


def _build(algo: AlgorithmConfig) -> CorrectionSpec:
    cfg: RolloutCorrectionConfig = algo.rollout_correction
    preset = PRESETS.get(cfg.preset)
    if preset is None and not cfg.weights and not cfg.reject:
        preset = _Preset("token", algo.tis_cap) if algo.tis_cap is not None else None
    preset = preset or _Preset()
    weights = preset.weights if cfg.weights == "" else cfg.weights
    reject = tuple(Criterion(r.criterion, r.lower, r.upper) for r in cfg.reject)  # type: ignore[arg-type]
    return CorrectionSpec(
        weights=None if weights == "none" else weights,
        upper=cfg.weight_upper if cfg.weight_upper is not None else preset.upper,
        lower=cfg.weight_lower if cfg.weight_lower is not None else preset.lower,
        batch_normalize=cfg.batch_normalize,
        reject=reject or preset.reject,
        opsm_delta=cfg.opsm_delta,
    )
