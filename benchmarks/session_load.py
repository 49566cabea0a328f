"""N concurrent sessions x M turns against the session server, and a 100 MB body refused.

The server runs in its own process (a stand-in engine that answers at once, no model) on
127.0.0.1, so its memory is measurable: /proc/<pid>/status VmHWM. Every session starts
together and sends its M turns one after another, each turn's history extending the
last (as an agent's does). Prints: turns sent and answered, p50/p99 turn latency,
turns/s, the server's peak RSS; then the time to a 413 for a 100 MB body sent at full
speed, and the server's peak RSS growth while refusing it. Stops by itself.

    python benchmarks/session_load.py --sessions 200 --turns 5
"""

from __future__ import annotations

import argparse
import json
import re
import select
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    import httpx2 as httpx  # the HTTP client under recent openai releases
except ImportError:
    import httpx

from rltool.engines.base import Generation, RolloutEngine

SERVER_LIFETIME_S = 600  # the server process exits after this even if never told to
BIG_BODY = 100 * 10**6


class InstantEngine(RolloutEngine):
    """Answers every prompt at once with the same short reply."""

    def __init__(self, tokenizer):
        self.ids = [*tokenizer.encode("4", add_special_tokens=False), tokenizer.eos_token_id]

    @property
    def model_step(self) -> int:
        return 0

    def sync_weights(self, model_step: int) -> None:
        pass

    def load_weights(self, state_dict, model_step: int) -> None:
        pass

    def generate(self, prompts, sampling):
        n = len(self.ids)
        return [Generation(list(self.ids), [-0.1] * n, [0] * n, "stop", "4") for _ in prompts]


def serve(sessions: int) -> None:
    """The server process: opens sessions s0.., prints its URL and then their paths (with
    their tokens) as one JSON line, serves until stdin closes."""
    from rltool.demo.tokenizer import train_demo_tokenizer
    from rltool.sessions import TOOL_CHAT_TEMPLATE, SessionServer

    tok = train_demo_tokenizer()
    tok.chat_template = TOOL_CHAT_TEMPLATE
    with SessionServer(InstantEngine(tok), tok) as server:
        for i in range(sessions):
            server.open_session(f"s{i}")
        print(server.url, flush=True)
        paths = {f"s{i}": server.session_path(f"s{i}") for i in range(sessions)}
        print(json.dumps(paths), flush=True)
        done = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
        done.wait(SERVER_LIFETIME_S)


def kb(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M)[1])


def run_session(http: httpx.Client, base: str, turns: int, start: threading.Barrier):
    """M turns of the session at ``base`` (its URL, token included): (latency s, status) per
    turn."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    out = []
    start.wait()
    for t in range(turns):
        began = time.perf_counter()
        try:
            r = http.post(f"{base}/chat/completions", json={"messages": messages})
            status = r.status_code
        except httpx.HTTPError as exc:  # counted as unanswered, by kind
            status = type(exc).__name__
        out.append((time.perf_counter() - began, status))
        if status != 200:
            continue
        messages.append(
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
        )
        messages.append({"role": "user", "content": f"And turn {t + 1}?"})
    return out


def big_body(url: str, path: str, size: int) -> tuple[float, int, bytes]:
    """Send ``size`` bytes of body at full speed until the server answers:
    (seconds, body bytes sent by then, status line)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    chunk = b"x" * 2**20
    head = f"POST {path}/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    began = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        sent, reply = 0, b""
        while b"\r\n" not in reply:
            readable, writable, _ = select.select([sock], [sock] if sent < size else [], [], 30)
            if readable:
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
            elif writable:
                sent += sock.send(chunk[: size - sent])
            elif not readable:
                break  # 30 s without progress
        elapsed = time.perf_counter() - began
    return elapsed, sent, reply.split(b"\r\n", 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200, help="concurrent sessions")
    parser.add_argument("--turns", type=int, default=5, help="turns per session")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    cmd = [sys.executable, __file__, "--serve", str(args.sessions)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        if not url.startswith("http://127.0.0.1:"):
            raise SystemExit(f"the server process did not start (printed {url!r})")
        paths = json.loads(proc.stdout.readline())
        rss_idle = kb(proc.pid, "VmRSS")
        start = threading.Barrier(args.sessions)
        limits = httpx.Limits(max_connections=args.sessions)
        began = time.perf_counter()
        with (
            httpx.Client(timeout=120, limits=limits) as http,
            ThreadPoolExecutor(args.sessions) as pool,
        ):
            runs = pool.map(
                lambda i: run_session(http, url + paths[f"s{i}"], args.turns, start),
                range(args.sessions),
            )
            turns = [t for run in runs for t in run]
        wall = time.perf_counter() - began
        peak_load = kb(proc.pid, "VmHWM")
        latencies = sorted(lat for lat, status in turns if status == 200)
        failures: dict[str, int] = {}
        for _, status in turns:
            if status != 200:
                failures[str(status)] = failures.get(str(status), 0) + 1

        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        rss_before = kb(proc.pid, "VmRSS")
        seconds, sent, status_line = big_body(url, paths["s0"], BIG_BODY)
        growth = kb(proc.pid, "VmHWM") - rss_before
        after = httpx.get(url + "/health").status_code
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)

    def pct(p: float) -> float:
        return 1000 * latencies[min(len(latencies) - 1, int(p * len(latencies)))]

    rows = [
        ("sessions x turns", f"{args.sessions} x {args.turns}"),
        ("turns answered", f"{len(latencies)} / {len(turns)}"),
        ("not answered", json.dumps(failures) if failures else "0"),
        ("turn latency p50", f"{pct(0.50):.1f} ms" if latencies else "n/a"),
        ("turn latency p99", f"{pct(0.99):.1f} ms" if latencies else "n/a"),
        ("turns/s", f"{len(turns) / wall:.0f}"),
        ("server RSS idle", f"{rss_idle / 1024:.0f} MiB"),
        ("server peak RSS (VmHWM)", f"{peak_load / 1024:.0f} MiB"),
        ("100 MB body answered", status_line.decode(errors="replace")),
        ("100 MB body time to answer", f"{1000 * seconds:.0f} ms"),
        ("100 MB body bytes sent by then", f"{sent / 2**20:.1f} MiB"),
        ("100 MB body peak RSS growth", f"{growth / 1024:.1f} MiB"),
        ("server answers afterwards", str(after)),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
