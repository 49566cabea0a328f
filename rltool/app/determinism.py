"""``trainer.deterministic: true``: the same recipe and seed give the same metrics and
weights, as far as the parts of the run allow.

What it sets: ``torch.use_deterministic_algorithms(True)`` (an op without a deterministic
kernel raises instead of running a racy one), cuDNN's autotuner off, cuBLAS's fixed
workspace (``CUBLAS_WORKSPACE_CONFIG``, read when CUDA starts: set before any model
loads). The rest of a run is deterministic by construction in one process on one
machine: every random draw comes from generators seeded by ``trainer.seed``
(``seed_everything``; a step's training draws from (seed, step), training/controller.py;
each sample's tokens from its own stream, engines/hf_sampling.py), and torch's thread
count is ``trainer.threads`` (set in ``seed_everything``) or the machine's. What it
cannot make deterministic is listed by ``determinism_warnings`` and shown when a run
starts, as is a thread count left to the machine. Design: docs/replay.md#deterministic-mode
"""

from __future__ import annotations

import os

import torch

from rltool.config.schema import RecipeConfig

CUBLAS_WORKSPACE = ":4096:8"  # the setting CUDA's docs give for deterministic cuBLAS


def make_deterministic() -> None:
    """Deterministic kernels for the rest of this process (a process-wide setting)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def determinism_warnings(recipe: RecipeConfig) -> list[str]:
    """Why this recipe's runs will differ from each other despite ``trainer.deterministic``
    (empty when it is off or nothing stands in its way)."""
    if not recipe.trainer.deterministic:
        return []
    out = []
    if recipe.produce.mode == "async":
        out.append(
            "produce.mode=async: which weights version generates which tokens depends on "
            "timing, so the rollouts (and everything after them) differ between runs"
        )
    if recipe.rollout.backend == "ray":
        out.append(
            "rollout.backend=ray: groups come back from the workers in the order they "
            "finish, and each worker's sampling stream is its own"
        )
    if recipe.rollout.engine != "hf":
        out.append(
            f"rollout.engine={recipe.rollout.engine}: the engine's batching and kernels "
            "are outside torch's deterministic mode"
        )
    notes = [f"trainer.deterministic: not deterministic with {w}" for w in out]
    if recipe.trainer.threads is None:  # one machine's runs still match each other
        n = torch.get_num_threads()
        notes.append(
            f"trainer.deterministic: trainer.threads=null, so torch uses this machine's "
            f"{n} threads and float sums depend on the count; set trainer.threads={n} to "
            "match runs on other machines"
        )
    return notes
