"""Starting or joining the Ray cluster that the rollout workers run on.

Design: docs/production.md#starting-or-joining-ray
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import ray

from rltool.config.schema import RolloutConfig
from rltool.produce.ray_reaper import start_reaper


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


# A local Ray's sockets live at <temp>/ray/session_<date>_<time>_<pid>/sockets/plasma_store
# (about 70 characters after <temp>), and a socket path may not pass 107 bytes.
_RAY_SOCKET_TAIL = 70
_SOCKET_PATH_MAX = 107
SHORT_RAY_TMPDIR = "/tmp"


def ray_tmpdir(environ: Mapping[str, str]) -> str | None:
    """The RAY_TMPDIR a local Ray needs: None when the user chose one or the temporary
    directory (Ray's default) leaves room for its socket paths; else ``/tmp``."""
    if "RAY_TMPDIR" in environ:
        return None
    base = environ.get("TMPDIR") or tempfile.gettempdir()
    return SHORT_RAY_TMPDIR if len(base) + _RAY_SOCKET_TAIL > _SOCKET_PATH_MAX else None


@contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """ray.init replaces this process's SIGTERM handler (with ``sys.exit``) and its core
    worker installs a crash handler that dumps and aborts (exit 134): the caller's own
    handlers (a run's clean stop on Ctrl-C / SIGTERM) are put back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: set outside Python, nothing to put back
                signal.signal(sig, handler)


def connect_ray(rollout: RolloutConfig) -> RaySession:
    """Join ``rollout.ray_address``, reuse a connected Ray, or start a local one; the
    signal handlers stay this process's own."""
    if ray.is_initialized():
        return RaySession(owned=False, start_s=0.0)
    # no crash dump and abort on SIGTERM in this process (Ray's workers inherit it)
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    with _own_signal_handlers():
        return _connect(rollout)


def _connect(rollout: RolloutConfig) -> RaySession:
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
    if (tmpdir := ray_tmpdir(os.environ)) is not None:
        os.environ["RAY_TMPDIR"] = tmpdir
    ray.init(num_cpus=local_num_cpus(rollout), include_dashboard=False, **quiet)
    start_reaper()  # the local Ray's helpers die with this process, even by kill -9
    return RaySession(owned=True, start_s=time.perf_counter() - start)
