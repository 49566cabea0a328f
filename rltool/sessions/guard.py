"""Connection guards of the session server: a cap on open connections, a read deadline per
request, and a cap on one session's requests in flight.

Untrusted sandbox code reaches the server; these keep it from exhausting the trainer's
file descriptors (held sockets) or its event loop (a slowloris client sending a request
byte by byte), and keep refusals out of the log but one line per kind.
Design: docs/agent-loops.md#limits
"""

from __future__ import annotations

import asyncio
import logging
import resource
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 30.0  # a request's head and body must arrive within this, from its first byte
MAX_SESSION_REQUESTS = 16  # requests of one session in flight (each holds its own connection)


def default_max_connections() -> int:
    """A quarter of this process's open-file limit (so the trainer keeps the rest), 64 to 1024."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(64, min(1024, soft // 4))


class ConnectionGuard:
    """Figures shared by the protocol instances of one server (they run on its event loop)."""

    def __init__(self, max_connections: int, read_timeout_s: float):
        if max_connections < 1 or not read_timeout_s > 0:
            raise ValueError(
                f"max_connections {max_connections} and read_timeout_s {read_timeout_s}: "
                "must be at least 1 and above 0"
            )
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.open = 0  # connections held now
        self.refused = 0  # connections closed at once: max_connections were open
        self.timed_out = 0  # connections cut: a request did not arrive within read_timeout_s

    def refuse(self) -> None:
        self.refused += 1
        if self.refused == 1:  # one line, not one per connection; the total is in stats()
            log.warning(
                "session server: %d connections open, closing new ones (max_connections)",
                self.max_connections,
            )

    def cut(self) -> None:
        self.timed_out += 1
        if self.timed_out == 1:
            log.warning(
                "session server: a request did not arrive within %.1f s; its connection is "
                "closed (read_timeout_s)",
                self.read_timeout_s,
            )

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol under this guard (uvicorn.Config's ``http``)."""
        guard = self

        class GuardedH11(H11Protocol):
            _counted = False
            _deadline: asyncio.TimerHandle | None = None

            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                if guard.open >= guard.max_connections:
                    guard.refuse()
                    transport.abort()  # its fd is released now, not after a close handshake
                    return
                guard.open += 1
                self._counted = True
                super().connection_made(transport)
                self._arm()  # the first request's head must come in time too

            def connection_lost(self, exc: Exception | None) -> None:
                if not self._counted:  # refused: uvicorn never saw it
                    return
                guard.open -= 1
                self._counted = False
                self._disarm()
                super().connection_lost(exc)

            def data_received(self, data: bytes) -> None:
                super().data_received(data)
                # the deadline runs from a request's first byte until its last one
                if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
                    self._arm()
                else:
                    self._disarm()

            def _arm(self) -> None:
                if self._deadline is None:
                    self._deadline = self.loop.call_later(guard.read_timeout_s, self._expire)

            def _disarm(self) -> None:
                if self._deadline is not None:
                    self._deadline.cancel()
                    self._deadline = None

            def _expire(self) -> None:
                self._deadline = None
                if not self.transport.is_closing():
                    guard.cut()
                    self.transport.abort()

        return GuardedH11


class SessionSlots:
    """At most ``cap`` requests of one session in flight; the rest are refused (429), counted
    per session and logged once per session."""

    def __init__(self, cap: int):
        if cap < 1:
            raise ValueError(f"max_session_requests {cap}: must be at least 1")
        self.cap = cap
        self.busy: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self._lock = threading.Lock()  # pop_refused runs on the caller's thread

    @contextmanager
    def hold(self, session_id: str) -> Iterator[bool]:
        """Yields whether the request got a slot; a refusal is counted."""
        with self._lock:
            admitted = self.busy[session_id] < self.cap
            if admitted:
                self.busy[session_id] += 1
            else:
                self.refused[session_id] += 1
                first = self.refused[session_id] == 1
        if not admitted and first:
            log.warning(
                "session %s: more than %d requests at once; refusing the rest with 429 "
                "(max_session_requests)",
                session_id,
                self.cap,
            )
        try:
            yield admitted
        finally:
            if admitted:
                with self._lock:
                    self.busy[session_id] -= 1
                    if not self.busy[session_id]:
                        del self.busy[session_id]

    def pop_refused(self, session_id: str) -> int:
        with self._lock:
            return self.refused.pop(session_id, 0)
