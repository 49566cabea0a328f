"""Sessions of one server are kept apart and the server holds against hostile clients:
per-session tokens, a cap on one session's requests in flight, deeply nested JSON, slow
(slowloris) and held connections."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fake_engines import FixedReplyEngine

from rltool.sessions import SessionServer
from rltool.sessions.asgi import json_depth, parse_body
from rltool.sessions.protocol import ApiError

CHAT = {"messages": [{"role": "user", "content": "What is 2 + 3?"}]}


def connect(server: SessionServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def closed_after(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closes ``sock`` (EOF or reset); fails past ``limit_s``."""
    start = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_a_sample_cannot_post_into_its_siblings_session(tokenizer):
    engine = FixedReplyEngine(tokenizer, "hi")
    with SessionServer(engine, tokenizer) as server:
        server.open_session("g.0")
        server.open_session("g.1")
        own = server.base_url("g.0")  # all sample A's code knows
        assert httpx.post(server.base_url("g.1") + "/chat/completions", json=CHAT).is_success
        a_token = own.split("/")[-2]
        b_path = server.session_path("g.1")
        forged = [
            own.replace("/s/g.0/", "/s/g.1/"),  # its own token on the sibling's id
            f"{server.url}/s/g.1/guess/v1",
            f"{server.url}/s/g.1/v1",  # the old, tokenless route
            f"{server.url}/s/g.1/{b_path.split('/')[3][:-1]}/v1",  # all but one character
        ]
        statuses = [httpx.post(url + "/chat/completions", json=CHAT).status_code for url in forged]
        statuses.append(httpx.get(forged[0] + "/models").status_code)
        b = server.close_session("g.1")
        assert httpx.post(server.base_url("g.0") + "/chat/completions", json=CHAT).is_success
        a = server.close_session("g.0")
    assert statuses == [403, 403, 404, 403, 403]
    assert b.num_turns == 1 and a.num_turns == 1 and engine.prompts == 2  # nothing else recorded
    assert a_token not in b_path


def test_tokens_are_secret_and_per_session(tokenizer):
    server = SessionServer(FixedReplyEngine(tokenizer), tokenizer)
    paths = {server.session_path(server.open_session(f"s{i}").session_id) for i in range(50)}
    tokens = {p.split("/")[3] for p in paths}
    assert len(tokens) == 50 and all(len(t) >= 43 for t in tokens)  # 256 bits, urlsafe base64
    server.close_session("s0")
    with pytest.raises(ValueError, match="'s0' is not open"):
        server.session_path("s0")


class GatedEngine(FixedReplyEngine):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, "late")
        self.entered, self.release = threading.Event(), threading.Event()

    def generate(self, prompts, sampling):
        self.entered.set()
        assert self.release.wait(60), "the test never released the engine"
        return super().generate(prompts, sampling)


def test_a_session_over_its_request_cap_gets_429_logged_once(tokenizer, caplog):
    engine = GatedEngine(tokenizer)
    with (
        SessionServer(engine, tokenizer, max_session_requests=1) as server,
        ThreadPoolExecutor(2) as pool,
    ):
        server.open_session("busy")
        server.open_session("other")
        url = server.base_url("busy") + "/chat/completions"
        first = pool.submit(httpx.post, url, json=CHAT, timeout=60)
        assert engine.entered.wait(60)
        with caplog.at_level(logging.WARNING):
            refused = [httpx.post(url, json=CHAT, timeout=30) for _ in range(20)]
        other = pool.submit(httpx.post, server.base_url("other") + "/chat/completions", json=CHAT)
        engine.release.set()
        assert first.result().status_code == 200 and other.result().status_code == 200
        assert httpx.post(url, json=CHAT, timeout=30).status_code == 200  # a slot again
        with caplog.at_level(logging.WARNING):
            busy = server.close_session("busy")
    assert {r.status_code for r in refused} == {429}
    assert {r.headers["connection"] for r in refused} == {"close"}
    assert "max_session_requests" in refused[0].json()["error"]["message"]
    assert busy.num_turns == 2
    lines = [r.getMessage() for r in caplog.records if "busy" in r.getMessage()]
    assert len(lines) == 2 and "20 requests refused" in lines[1]  # not one line per refusal


def test_json_nested_100k_deep_is_a_400_without_a_traceback(tokenizer, caplog):
    deep = b"[" * 100_000 + b"]" * 100_000
    with SessionServer(FixedReplyEngine(tokenizer), tokenizer) as server:
        server.open_session("d")
        url = server.base_url("d") + "/chat/completions"
        with caplog.at_level(logging.DEBUG):
            r = httpx.post(url, content=deep, timeout=60)
            nested = {"messages": CHAT["messages"], "x": json.loads("[" * 70 + "]" * 70)}
            r70 = httpx.post(url, json=nested, timeout=60)
            ok = httpx.post(url, json=CHAT, timeout=60)
    assert r.status_code == 400 and "nests JSON" in r.json()["error"]["message"]
    assert r70.status_code == 400 and "71 levels deep" in r70.json()["error"]["message"]
    assert ok.status_code == 200
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]


def test_json_depth_is_counted_without_recursion():
    assert [json_depth(v) for v in (1, [], {"a": [1, {"b": []}]}, [[[]], 2])] == [0, 1, 4, 3]
    assert parse_body(b'{"a": [1]}') == {"a": [1]}
    with pytest.raises(ApiError, match="3 levels deep; this server takes at most 2"):
        parse_body(b"[[[]]]", max_depth=2)
    with pytest.raises(ApiError, match="not JSON"):
        parse_body(b"{")


@pytest.mark.parametrize("stage", ["idle", "head", "body"])
def test_a_slow_client_is_cut_at_the_read_timeout_and_others_are_served(tokenizer, stage):
    with SessionServer(FixedReplyEngine(tokenizer), tokenizer, read_timeout_s=1.0) as server:
        server.open_session("s")
        head = (
            f"POST {server.session_path('s')}/chat/completions HTTP/1.1\r\nHost: x\r\n"
            "Content-Length: 1000\r\n\r\n"
        ).encode()
        sock, opened = connect(server), time.monotonic()
        stop = threading.Event()

        def dribble() -> None:  # one byte every 0.1 s, for up to 20 s
            data = head if stage == "head" else head + b"x" * 1000
            start = 0 if stage == "head" else len(head)
            if stage == "body":
                sock.sendall(head)
            for i in range(start, len(data)):
                if stop.wait(0.1):
                    return
                try:
                    sock.sendall(data[i : i + 1])
                except OSError:
                    return

        with sock, ThreadPoolExecutor(1) as pool:
            if stage != "idle":
                pool.submit(dribble)
            time.sleep(0.3)
            served = httpx.post(server.base_url("s") + "/chat/completions", json=CHAT, timeout=30)
            closed_after(sock, 20.0)
            waited = time.monotonic() - opened
            stop.set()
        assert served.status_code == 200
        assert 0.9 < waited < 15.0  # cut near 1 s from its start, not after the 20 s dribble
        assert server.guard.timed_out == 1
        assert server.close_session("s").num_turns == 1


def test_connections_past_the_cap_are_closed_at_once(tokenizer, caplog):
    with (
        SessionServer(FixedReplyEngine(tokenizer), tokenizer, max_connections=4) as server,
        caplog.at_level(logging.WARNING),
    ):
        held = [connect(server) for _ in range(4)]
        time.sleep(0.2)
        extra = [connect(server) for _ in range(10)]
        waits = [closed_after(s, 10.0) for s in extra]
        for s in held + extra:
            s.close()
        deadline = time.monotonic() + 10
        while server.guard.open and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert max(waits) < 5.0 and server.guard.refused == 10
    assert len([r for r in caplog.records if "max_connections" in r.getMessage()]) == 1


def test_a_flood_of_malformed_requests_is_not_a_flood_of_log_lines(tokenizer, caplog):
    with (
        SessionServer(FixedReplyEngine(tokenizer), tokenizer) as server,
        caplog.at_level(logging.DEBUG),
    ):
        for _ in range(100):
            with connect(server) as sock:
                sock.sendall(b"NOT HTTP\r\n\r\n")
                assert sock.recv(4096).startswith(b"HTTP/1.1 400")
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 0
