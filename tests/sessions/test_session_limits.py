"""The session server under hostile input and load: body limit, bad headers, many turns,
session ids, the API key, and a clean stop."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from fake_engines import FixedReplyEngine

from rltool.sessions import SessionServer
from rltool.sessions.server import is_loopback

try:
    import httpx2 as httpx  # the HTTP client under recent openai releases
except ImportError:
    import httpx

CHAT = {"messages": [{"role": "user", "content": "What is 2 + 3?"}]}
LIMIT = 64 * 1024


def status_kb(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M)[1])


def raw_status(server: SessionServer, head: bytes) -> bytes:
    """The status line the server answers to ``head`` (a request without its body)."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply.split(b"\r\n", 1)[0]


def test_a_body_over_the_limit_is_refused_with_413_without_being_read(tokenizer):
    body = b"x" * (64 * 2**20)  # allocated before the baseline: only the server's memory counts
    with SessionServer(
        FixedReplyEngine(tokenizer, "hi"), tokenizer, max_body_bytes=LIMIT
    ) as server:
        server.open_session("big")
        with httpx.Client(base_url=server.base_url("big"), timeout=60) as http:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            except OSError as exc:
                pytest.skip(f"cannot reset the peak RSS here: {exc}")
            base = status_kb("VmRSS")
            declared = http.post("/chat/completions", content=body)
            chunked = http.post("/chat/completions", content=iter([body[:LIMIT], body[:LIMIT]]))
            growth_kb = status_kb("VmHWM") - base
            for r in (declared, chunked):
                assert r.status_code == 413
                error = r.json()["error"]
                assert error["code"] == 413 and "max_body_bytes" in error["message"]
            assert f"{len(body)} bytes" in declared.json()["error"]["message"]
            # the server still answers, on the same keep-alive client
            ok = http.post("/chat/completions", json=CHAT)
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "hi"
    assert growth_kb < 16 * 1024, f"RSS grew {growth_kb} kB for a refused 64 MiB body"


@pytest.mark.parametrize(
    ("length", "status"),
    [(b"abc", b"400"), (b"-1", b"400"), (b"1 2", b"400"), (b"100000000000", b"413")],
)
def test_a_malformed_or_huge_content_length_gets_an_answer(tokenizer, length, status):
    with SessionServer(FixedReplyEngine(tokenizer), tokenizer, max_body_bytes=LIMIT) as server:
        server.open_session("h")
        path = server.session_path("h").encode()
        head = b"POST " + path + b"/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
        assert raw_status(server, head + length + b"\r\n\r\n").split(b" ")[1] == status
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_two_hundred_concurrent_turns_are_all_answered(tokenizer):
    n = 200
    engine = FixedReplyEngine(tokenizer, "ok")
    with SessionServer(engine, tokenizer, max_session_requests=50) as server:
        ids = [server.open_session().session_id for _ in range(n - 50)]
        shared = server.open_session("shared")  # 50 turns at once on one session too
        ids += ["shared"] * 50
        barrier = threading.Barrier(n)
        limits = httpx.Limits(max_connections=n)  # one connection per turn in flight

        def turn(sid: str) -> int:
            barrier.wait()
            return http.post(server.base_url(sid) + "/chat/completions", json=CHAT).status_code

        with httpx.Client(timeout=120, limits=limits) as http, ThreadPoolExecutor(n) as pool:
            statuses = list(pool.map(turn, ids))
        sessions = [server.close_session(sid) for sid in set(ids)]
    assert statuses == [200] * n
    assert engine.prompts == n
    assert sorted(s.num_turns for s in sessions) == [1] * (n - 50) + [50]
    assert shared.num_turns == 50


def test_server_made_session_ids_come_from_secrets(tokenizer, monkeypatch):
    server = SessionServer(FixedReplyEngine(tokenizer), tokenizer)
    a, b = server.open_session().session_id, server.open_session().session_id
    assert re.fullmatch(r"[0-9a-f]{32}", a) and a != b  # 128 random bits each
    monkeypatch.setattr("rltool.sessions.server.secrets.token_hex", lambda n: f"t{n}")
    assert server.open_session().session_id == "t16"


def test_loopback_is_told_apart_from_other_hosts():
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost")] == [True] * 4
    assert [is_loopback(h) for h in ("0.0.0.0", "10.1.2.3", "::", "example.com")] == [False] * 4


def test_a_non_loopback_bind_needs_an_api_key_and_checks_it(tokenizer):
    with pytest.raises(ValueError, match=r"host '0\.0\.0\.0' is not a loopback.*api_key"):
        SessionServer(FixedReplyEngine(tokenizer), tokenizer, host="0.0.0.0")
    engine = FixedReplyEngine(tokenizer, "hi")
    with SessionServer(engine, tokenizer, host="0.0.0.0", api_key="s3cret") as server:
        server.open_session("k")
        url = server.base_url("k").replace("0.0.0.0", "127.0.0.1")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for r in (
                httpx.post(url + "/chat/completions", json=CHAT, headers=headers),
                httpx.get(url + "/models", headers=headers),
                httpx.get(url.split("/s/")[0] + "/health", headers=headers),
            ):
                assert r.status_code == 401
                assert "Bearer <api_key>" in r.json()["error"]["message"]
        assert engine.prompts == 0
        client = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        r = client.chat.completions.create(model="p", messages=CHAT["messages"])
        assert r.choices[0].message.content == "hi"


def test_stop_leaves_no_thread_socket_or_socket_file(tokenizer, socket_dir):
    def fds() -> set[tuple[str, str]]:  # (fd, what it is): a reused number reads differently
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(FileNotFoundError):  # the listing's own fd, now closed
                out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        return out

    gc.collect()
    threads, before = set(threading.enumerate()), fds()
    sock = socket_dir / "s.sock"
    with SessionServer(FixedReplyEngine(tokenizer), tokenizer, unix_socket=sock) as server:
        server.open_session("z")
        with httpx.Client() as http:
            assert http.post(server.base_url("z") + "/chat/completions", json=CHAT).is_success
        during = fds() - before
        assert sum(what.startswith("socket:") for _, what in during) >= 2  # TCP + Unix
    assert set(threading.enumerate()) == threads
    assert fds() - before == set()
    assert not sock.exists()


class GatedEngine(FixedReplyEngine):
    """Holds each engine call until released, telling when one has started."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, "late")
        self.entered, self.release = threading.Event(), threading.Event()

    def generate(self, prompts, sampling):
        self.entered.set()
        assert self.release.wait(60), "the test never released the engine"
        return super().generate(prompts, sampling)


def test_an_engine_call_in_flight_does_not_block_the_server(tokenizer):
    engine = GatedEngine(tokenizer)
    with SessionServer(engine, tokenizer) as server, ThreadPoolExecutor(1) as pool:
        server.open_session("slow")
        url = server.base_url("slow") + "/chat/completions"
        turn = pool.submit(httpx.post, url, json=CHAT, timeout=60)
        assert engine.entered.wait(60)
        # the event loop still serves while the engine works
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert httpx.get(server.base_url("slow") + "/models", timeout=10).status_code == 200
        engine.release.set()
        assert turn.result().json()["choices"][0]["message"]["content"] == "late"
