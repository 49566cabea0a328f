"""Starting or joining the Ray cluster that the rollout workers run on.

Design: docs/production.md#starting-or-joining-ray
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import ray

from rltool.config.schema import RolloutConfig


@dataclass(frozen=True, slots=True)
class RaySession:
    # ray.init was called here: close() calls ray.shutdown, which stops a local Ray
    # and only disconnects from a cluster
    owned: bool
    start_s: float  # seconds ray.init took (0 when reused)


def local_num_cpus(rollout: RolloutConfig) -> int:
    """CPUs a local Ray advertises: the machine's, or enough to place every worker.

    Each worker actor asks for ``worker_threads`` CPUs; a local Ray with fewer
    would leave actors unscheduled forever rather than fail.
    """
    return max(os.cpu_count() or 1, rollout.num_workers * rollout.worker_threads)


def connect_ray(rollout: RolloutConfig) -> RaySession:
    """Join ``rollout.ray_address``, reuse a connected Ray, or start a local one."""
    if ray.is_initialized():
        return RaySession(owned=False, start_s=0.0)
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
    start = time.perf_counter()
    if rollout.ray_address:
        try:
            ray.init(address=rollout.ray_address, **quiet)
        except (ConnectionError, RuntimeError) as e:
            raise ValueError(
                f"rollout.ray_address: cannot connect to Ray at {rollout.ray_address!r} ({e}); "
                "start the cluster with `ray start --head`, or set rollout.ray_address: null "
                "for a local Ray"
            ) from e
        return RaySession(owned=True, start_s=time.perf_counter() - start)
    # read by the Ray processes ray.init spawns; setdefault keeps a user's own choice
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=local_num_cpus(rollout), include_dashboard=False, **quiet)
    return RaySession(owned=True, start_s=time.perf_counter() - start)
