"""Task rows drawn from a reasoning-gym generator (``data.preset: reasoning_gym``).

reasoning-gym draws row ``i`` of a dataset with ``random.Random(seed + i)``, so a split of
``size`` rows uses the seeds ``[seed, seed + size)``; the held-out split uses its own range
``[eval_seed, eval_seed + eval_size)``, checked not to overlap the training range (two
seeds that differ by less than ``size`` would share rows). The package is imported lazily:
without it, the error names the extra to install before any model loads.
Design: docs/environments.md#reasoning-gym
"""

from __future__ import annotations

from typing import Any

from rltool.config.schema import ReasoningGymConfig

PRESET = "reasoning_gym"
ROW_KEY = "reasoning_gym"  # the row's generator fields; the gsm8k loop scores rows that have it
INSTALL = "pip install 'rltool[reasoning-gym]'"
ANSWER_FORMATS = ("answer_tag", "gsm8k")
_OWN_KEYS = ("seed", "size")  # set by rltool per split, never in the generator's config


def import_reasoning_gym(what: str) -> Any:
    """The ``reasoning_gym`` module, or a ValueError naming ``what`` needs it and the
    install command."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ValueError(
            f"{what} needs the reasoning-gym package, which is not installed; install the "
            f"extra: {INSTALL} (or build the environments venv: bash scripts/envs_env.sh)"
        ) from exc
    return reasoning_gym


def split_seeds(cfg: ReasoningGymConfig, where: str) -> tuple[range, range]:
    """(train seeds, eval seeds): the disjoint seed ranges of the two splits."""
    train = range(cfg.seed, cfg.seed + cfg.size)
    eval_seed = cfg.seed + cfg.size if cfg.eval_seed is None else cfg.eval_seed
    held_out = range(eval_seed, eval_seed + cfg.eval_size)
    if held_out and train.start < held_out.stop and held_out.start < train.stop:
        raise ValueError(
            f"{where}.reasoning_gym: the held-out seeds [{held_out.start}, {held_out.stop}) "
            f"overlap the training seeds [{train.start}, {train.stop}) (row i is drawn with "
            f"seed + i), so eval rows would repeat training rows; set eval_seed >= "
            f"{train.stop} or <= {train.start - cfg.eval_size}, or leave it null"
        )
    return train, held_out


def task_row(entry: dict[str, Any], cfg: ReasoningGymConfig, seed: int) -> dict[str, Any]:
    """The canonical row of one generator entry (``question``, ``answer``, ``metadata``):
    the question is the prompt, the answer the ground truth as a string, and the entry
    itself is kept (``score_answer`` reads it, metadata included)."""
    return {
        "question": entry["question"],
        "answer": str(entry["answer"]),
        ROW_KEY: {
            "dataset": cfg.dataset,
            "config": dict(cfg.config),
            "answer_format": cfg.answer_format,
            "seed": seed,  # the row's own seed: split seed + index
            "entry": entry,
        },
    }


def generator_rows(
    cfg: ReasoningGymConfig, where: str, evaluation: bool
) -> list[tuple[str, dict[str, Any]]]:
    """The rows of one split, each after where it comes from
    (``reasoning_gym:chain_sum seed 1003``); ValueErrors name ``where`` and the key."""
    rg = import_reasoning_gym(f"{where}.preset reasoning_gym")
    key = f"{where}.reasoning_gym"
    if not cfg.dataset:
        raise ValueError(f"{key}.dataset is empty: name a reasoning-gym generator (chain_sum, ...)")
    known = sorted(rg.factory.DATASETS)
    if cfg.dataset not in known:
        raise ValueError(
            f"{key}.dataset {cfg.dataset!r} is not a reasoning-gym generator; known: "
            f"{', '.join(known)}"
        )
    own = [k for k in _OWN_KEYS if k in cfg.config]
    if own:
        raise ValueError(
            f"{key}.config sets {', '.join(own)}: set {key}.seed / size / eval_seed / "
            "eval_size instead (rltool draws each split from its own seeds)"
        )
    train, held_out = split_seeds(cfg, where)
    seeds = held_out if evaluation else train
    if not seeds:
        return []
    try:
        dataset = rg.create_dataset(cfg.dataset, seed=seeds.start, size=len(seeds), **cfg.config)
    except (TypeError, ValueError, AssertionError) as exc:  # the generator's config check
        raise ValueError(f"{key}.config is not a valid {cfg.dataset} config: {exc}") from exc
    return [
        (f"{PRESET}:{cfg.dataset} seed {seed}", task_row(entry, cfg, seed))
        for seed, entry in zip(seeds, dataset, strict=True)
    ]
