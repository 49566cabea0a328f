"""TEST FIXTURE: a rollout server that hangs: it accepts connections on 127.0.0.1 and never
answers (``answer_after_s`` None), or answers every request with HTTP 503 only after that
many seconds (a slow, failing server). The fake that dies is
``completions_fixture.FixtureCompletionsServer.kill``."""

from __future__ import annotations

import socket
import threading
import time

_503 = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class HungServer:
    """``url`` is its base URL (…/v1); ``accepted`` counts the connections it took."""

    def __init__(self, answer_after_s: float | None = None):
        self.answer_after_s = answer_after_s
        self.accepted = 0
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self._sock.settimeout(0.05)  # the accept loop checks for close() this often
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            self.accepted += 1
            self._held.append(conn)
            if self.answer_after_s is not None:
                threading.Thread(target=self._answer_late, args=(conn,), daemon=True).start()

    def _answer_late(self, conn: socket.socket) -> None:
        time.sleep(self.answer_after_s or 0.0)
        try:
            conn.recv(1 << 16)  # the request (read, so that closing sends no reset)
            conn.sendall(_503)
            conn.close()
        except OSError:  # the client gave up first
            pass

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        for conn in self._held:
            conn.close()
