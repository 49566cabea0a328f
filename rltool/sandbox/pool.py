"""SandboxPool: at most ``max_concurrent`` sandboxes at once, all killed and removed on close.

Run sandboxes from your own threads (``run``/``run_check``) or hand them to the pool's
(``submit``/``map``). Design: docs/sandbox.md#the-pool
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from rltool.sandbox.limits import SandboxLimits
from rltool.sandbox.run import CheckedRun, SandboxProcess, SandboxResult, run_check, run_sandbox
from rltool.sandbox.spec import SandboxSpec

CLOSED_REASON = "sandbox pool closed"


class SandboxPool:
    def __init__(self, max_concurrent: int) -> None:
        if max_concurrent < 1:
            raise ValueError(f"SandboxPool.max_concurrent must be >= 1, got {max_concurrent}")
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._lock = threading.Lock()
        self._live: set[SandboxProcess] = set()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix="sandbox")

    # Tracker protocol: every sandbox started through the pool registers here.
    def add(self, process: SandboxProcess) -> None:
        with self._lock:
            self._live.add(process)
            closed = self._closed
        if closed:  # started while the pool was closing: do not let it run
            process.kill(CLOSED_REASON)

    def discard(self, process: SandboxProcess) -> None:
        with self._lock:
            self._live.discard(process)

    def live_count(self) -> int:
        with self._lock:
            return len(self._live)

    def run(self, spec: SandboxSpec) -> SandboxResult:
        """``run_sandbox`` within the pool's concurrency bound."""
        with self._slot():
            return run_sandbox(spec, tracker=self)

    def run_check(
        self,
        spec: SandboxSpec,
        check_command: Sequence[str],
        *,
        limits: SandboxLimits | None = None,
        ro_binds: Sequence[tuple[str | Path, str]] = (),
    ) -> CheckedRun:
        """``run_check`` (agent then check, one slot for both) within the bound."""
        with self._slot():
            return run_check(spec, check_command, limits=limits, ro_binds=ro_binds, tracker=self)

    def submit(self, spec: SandboxSpec) -> Future[SandboxResult]:
        self._raise_if_closed()
        return self._executor.submit(self.run, spec)

    def map(self, specs: Iterable[SandboxSpec]) -> list[SandboxResult]:
        """Run all specs on the pool's threads; results in the order given."""
        futures = [self.submit(spec) for spec in specs]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Kill every running sandbox, cancel queued ones, wait for cleanup."""
        with self._lock:
            self._closed = True
            live = list(self._live)
        for process in live:
            process.kill(CLOSED_REASON)
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("SandboxPool is closed: create a new pool to run more sandboxes")

    @contextmanager
    def _slot(self) -> Iterator[None]:
        """Hold one concurrency slot; refuse to start once the pool is closed."""
        self._raise_if_closed()
        with self._slots:
            self._raise_if_closed()
            yield
