"""A pool of OpenAI-compatible servers: requests spread over them, bounded, retried elsewhere.

Each request goes to the live server with the fewest requests in flight; one that fails
(connection refused or reset, timeout, a 5xx answer) is retried on another server and
counted. A server that does not answer in time (hung) is dropped for good, as is one that
misses a weight update; ``deadline_s`` bounds a whole round of requests, retries included.
A 4xx answer is the request's own fault and is raised at once. Design:
docs/engines.md#the-openai-server-engine
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from rltool.engines.base import ServersDown

__all__ = ["ServerPool", "ServersDown", "check_server_urls"]

log = logging.getLogger(__name__)
DEV_MODE_HINT = (
    "A vLLM server needs VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
    "rltool.engines.vllm_worker.RltoolWorkerExtension (docs/engines.md)"
)
# a server silent for an attempt's whole timeout is hung when that timeout was at least this
# share of min(timeout_s, deadline_s); an attempt the deadline cut shorter merely fails
HUNG_SHARE = 0.5


@dataclass(slots=True)
class _Server:
    url: str  # base URL without a trailing slash, e.g. http://127.0.0.1:8000/v1
    root: str  # the URL without its /v1 (vLLM's /collective_rpc lives there)
    in_flight: int = 0
    failed: bool = False  # its last request failed: chosen only when no other is left
    out: bool = False  # dropped (missed a weight update, or hung): never chosen again
    why: str = ""  # why it was dropped
    answered: int = 0  # requests it answered (for tests and the benchmark)


def check_server_urls(urls: Sequence[str]) -> list[str]:
    """The URLs without trailing slashes; a ValueError naming ``rollout.servers`` if one is
    not an http(s) URL or the list is empty."""
    if not urls:
        raise ValueError(
            "rollout.servers is empty: rollout.engine openai_server needs at least one "
            "server URL, e.g. rollout.servers=[http://127.0.0.1:8000/v1]"
        )
    out = []
    for i, u in enumerate(urls):
        if not isinstance(u, str) or not u.startswith(("http://", "https://")):
            raise ValueError(f"rollout.servers[{i}] = {u!r}: must be an http:// or https:// URL")
        out.append(u.rstrip("/"))
    if len(set(out)) != len(out):
        raise ValueError(f"rollout.servers lists a server twice: {out}")
    return out


@dataclass
class ServerPool:
    """The servers of one engine; thread-safe. ``post_spread`` fans requests out,
    ``post_each`` sends one request to every server (weight updates)."""

    urls: Sequence[str]
    timeout_s: float = 600.0
    retries: int = 2
    concurrency: int = 8
    api_key: str | None = None
    deadline_s: float | None = None  # one post_spread call, queueing and retries included
    _servers: list[_Server] = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _retried: int = field(init=False, default=0)
    _dropped: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        urls = check_server_urls(self.urls)
        self._servers = [_Server(u, u.removesuffix("/v1")) for u in urls]
        headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
        total = len(urls) * self.concurrency
        self._client = httpx.Client(
            timeout=self.timeout_s,
            headers=headers,
            limits=httpx.Limits(max_connections=total, max_keepalive_connections=total),
        )
        self._executor = ThreadPoolExecutor(total, thread_name_prefix="rltool-openai")

    @property
    def answered(self) -> dict[str, int]:
        """Requests answered per server URL."""
        return {s.url: s.answered for s in self._servers}

    @property
    def live(self) -> list[str]:
        """URLs of the servers still in the pool."""
        return [s.url for s in self._servers if not s.out]

    def pop_counts(self) -> tuple[int, int]:
        """(requests retried on another server, servers dropped) since the last call."""
        with self._lock:
            counts = (self._retried, self._dropped)
            self._retried = self._dropped = 0
        return counts

    def post_spread(self, path: str, bodies: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """POST each body to ``<server url><path>``, spread over the servers, at most
        ``concurrency`` in flight per server; the JSON answers, in order. With
        ``deadline_s`` no request waits (queued or on any attempt) past that many seconds
        from this call: each attempt's timeout is cut to what is left."""
        deadline = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        futures = [self._executor.submit(self._post_retrying, path, b, deadline) for b in bodies]
        answers, down = [], []
        for f in futures:  # all of them: a failed request leaves the others running
            try:
                answers.append(f.result())
            except ServersDown as exc:
                down.append(exc)
        if down and not self.live:  # the whole pool is gone: name every server
            raise ServersDown(self._down_text()) from down[0]
        if down:
            raise down[0]
        return answers

    def post_each(
        self, path: str, body: dict[str, Any], root: bool = False, hint: str = DEV_MODE_HINT
    ) -> list[Any]:
        """POST ``body`` to every server still in the pool (at its root URL when ``root``);
        the JSON answers (None for an empty one, the text for one that is not JSON). A
        server that does not answer (down, 5xx) is dropped from the pool for good and
        counted; a 4xx answer raises with ``hint`` (the server lacks what rltool asks of
        it); no server left raises ``ServersDown`` naming each."""
        out = []
        for i in [i for i, s in enumerate(self._servers) if not s.out]:
            s = self._servers[i]
            url = (s.root if root else s.url) + path
            try:
                r = self._client.post(url, json=body)
            except httpx.HTTPError as exc:
                r, reason = None, _failure(exc, self.timeout_s, "timeout_s")
            if r is not None and 400 <= r.status_code < 500:
                raise RuntimeError(
                    f"openai_server: {url} refused {body.get('method', path)!r} "
                    f"({r.status_code}): {r.text[:500]}. {hint}"
                )
            if r is not None and r.status_code < 400:
                out.append(_json_or_text(r))
                continue
            self._drop(i, f"{path}: {reason if r is None else f'HTTP {r.status_code}'}")
        if not out:
            raise ServersDown(self._down_text())
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def _down_text(self) -> str:
        """Every server and why it was dropped (all are)."""
        with self._lock:
            named = "; ".join(f"{s.url} ({s.why})" for s in self._servers)
        return (
            f"openai_server: no server left in rollout.servers: {named}. Check that they "
            "are running and answer in time (rollout.server.timeout_s, deadline_s); a "
            "dropped server takes part again when the run is resumed (rltool train --resume)"
        )

    def _drop(self, i: int, why: str) -> None:
        """Server ``i`` is out for good (it missed weights, or hangs): counted and named."""
        with self._lock:
            s = self._servers[i]
            if s.out:
                return
            s.out, s.why = True, why
            self._dropped += 1
            left = [x.url for x in self._servers if not x.out]
        log.warning(
            "openai_server: %s dropped from rollout.servers (%s); %d left%s",
            s.url, why, len(left), f": {', '.join(left)}" if left else "",
        )  # fmt: skip

    def _pick(self, tried: set[int]) -> int:
        with self._lock:
            live = [i for i, s in enumerate(self._servers) if not s.out]
            if live:
                left = [i for i in live if i not in tried] or live
                best = min(
                    left, key=lambda i: (self._servers[i].failed, self._servers[i].in_flight)
                )
                self._servers[best].in_flight += 1
                return best
        raise ServersDown(self._down_text())

    def _done(self, i: int, ok: bool) -> None:
        with self._lock:
            s = self._servers[i]
            s.in_flight -= 1
            s.failed = not ok
            s.answered += ok

    def _post_retrying(
        self, path: str, body: dict[str, Any], deadline: float | None
    ) -> dict[str, Any]:
        tried: set[int] = set()
        why: list[str] = []
        full = min(self.timeout_s, self.deadline_s or self.timeout_s)
        for attempt in range(1 + self.retries):
            timeout, key = self.timeout_s, "timeout_s"
            if deadline is not None and deadline - time.monotonic() < timeout:
                timeout, key = deadline - time.monotonic(), "deadline_s"
                if timeout <= 0:
                    why.append(f"rollout.server.deadline_s = {self.deadline_s:g} passed")
                    break
            if attempt > 0:
                with self._lock:
                    self._retried += 1
            i = self._pick(tried)
            tried.add(i)
            url = self._servers[i].url + path
            ok, answer, hung = _post_once(self._client.post, url, body, timeout, key)
            self._done(i, ok)
            if ok:
                return answer
            if hung and timeout >= HUNG_SHARE * full:  # it would hold every request sent to it
                self._drop(i, f"{path}: {answer}")
            why.append(f"{url} ({answer})")
        raise ServersDown(
            f"openai_server: no server answered a request in {len(tried)} attempts "
            f"(rollout.server.retries = {self.retries}): {'; '.join(why)}. "
            "Check that the servers in rollout.servers are running and reachable."
        )


def _json_or_text(r: httpx.Response) -> Any:
    """An answer's JSON, None when empty, its text when not JSON (vLLM's
    ``/v1/load_lora_adapter`` answers a sentence)."""
    if not r.content:
        return None
    try:
        return r.json()
    except ValueError:
        return r.text


def _failure(exc: httpx.HTTPError, timeout: float, key: str) -> str:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.PoolTimeout):
        return f"no answer within {timeout:.3g} s (rollout.server.{key}; {type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


def _post_once(
    post: Callable[..., httpx.Response], url: str, body: dict[str, Any], timeout: float, key: str
) -> tuple:
    """(True, JSON, False) or (False, why, hung) for a failure another server may not
    have; hung: the server took the whole ``timeout`` (not our own connection pool's wait).
    Raises ValueError for a 4xx answer (the request itself is wrong: every server would
    refuse)."""
    try:
        r = post(url, json=body, timeout=timeout)
    except httpx.HTTPError as exc:  # refused, reset, timed out: the server, not the request
        hung = isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.PoolTimeout)
        return False, _failure(exc, timeout, key), hung
    if 400 <= r.status_code < 500:
        raise ValueError(
            f"openai_server: {url} refused the request ({r.status_code}): {r.text[:500]}"
        )
    if r.status_code >= 500:
        return False, f"HTTP {r.status_code}: {r.text[:200]}", False
    try:
        return True, r.json(), False
    except ValueError:
        return False, f"an answer that is not JSON: {r.text[:200]!r}", False
