"""Clean interruption: Ctrl-C or SIGTERM finishes the current step, saves, and stops."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class SecondInterrupt(KeyboardInterrupt):
    """The second Ctrl-C: stop now, without a save."""


class StopRequest:
    """Ctrl-C / SIGTERM: finish the current step, save, exit. A second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise SecondInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
