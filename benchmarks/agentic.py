"""Agentic rollout overheads: the session server per turn, and the sandbox start-to-exit.

Session server: an agent drives a growing tool conversation through the official
``openai`` client and the session server (HTTP, chat-template render, prefix
alignment, recording); after each turn the bare engine runs on the same context.
It prints the medians of both, the overhead in ms and the ratio.

    python benchmarks/agentic.py                        # fake engine, 20 ms a call
    python benchmarks/agentic.py --latency-ms 0         # the server's own cost alone
    python benchmarks/agentic.py --engine hf            # tiny random Qwen2, greedy

The sandbox part is measured by ``benchmarks/sandbox_start.py`` (another
module); ``sandbox_start_to_exit`` below runs it when it is there.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import openai

from rltool.config.schema import SamplingConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.engines.base import Generation, RolloutEngine
from rltool.sessions import TOOL_CHAT_TEMPLATE, SessionServer, export

TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {}, "b": {}}},
    },
}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class ConstantLatencyEngine(RolloutEngine):
    """Sleeps a fixed time per call and says the same tool call every turn."""

    def __init__(self, tokenizer: Any, latency_s: float):
        self.latency_s = latency_s
        self.ids = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
        self.text = CALL

    @property
    def model_step(self) -> int:
        return 0

    def sync_weights(self, model_step: int) -> None:
        pass

    def load_weights(self, state_dict, model_step: int) -> None:
        pass

    def generate(self, prompts, sampling):
        time.sleep(self.latency_s)
        n = len(self.ids)
        return [Generation(self.ids, [-0.5] * n, [0] * n, "stop", self.text) for _ in prompts]


def hf_engine(tokenizer: Any) -> RolloutEngine:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rltool.engines.hf import HFEngine

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    return HFEngine(Qwen2ForCausalLM(config), tokenizer)


class Recorder(RolloutEngine):
    """Passes calls through and keeps each context, to replay them on the bare engine."""

    def __init__(self, inner: RolloutEngine):
        self.inner = inner
        self.contexts: list[list[int]] = []

    @property
    def model_step(self) -> int:
        return self.inner.model_step

    def sync_weights(self, model_step: int) -> None:
        self.inner.sync_weights(model_step)

    def load_weights(self, state_dict, model_step: int) -> None:
        self.inner.load_weights(state_dict, model_step)

    def generate(self, prompts, sampling):
        self.contexts += [list(p) for p in prompts]
        return self.inner.generate(prompts, sampling)


def session_turns(engine: RolloutEngine, tokenizer: Any, turns: int, sampling: SamplingConfig):
    """Per-turn ms through client + server, per-turn ms of the bare engine on the same
    context (run right after each turn, so both see the same machine load), the states."""
    recorder = Recorder(engine)
    served, bare = [], []
    with SessionServer(recorder, tokenizer, sampling) as server:
        server.open_session("bench")
        client = openai.OpenAI(base_url=server.base_url("bench"), api_key="-", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Add 2 and 3, repeatedly."}]
        for i in range(turns):
            t0 = time.perf_counter()
            r = client.chat.completions.create(model="p", messages=messages, tools=[TOOL])
            served.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()  # the server is idle between turns: the engine is free
            engine.generate([recorder.contexts[-1]], sampling)
            bare.append((time.perf_counter() - t0) * 1e3)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": f"call_{i}_0", "content": "5"})
        states = export(server.close_session("bench"), "g", "bench", 0.0)
    return served, bare, states


# ---- sandbox start-to-exit: measured by benchmarks/sandbox_start.py (another helper) ----
def sandbox_start_to_exit() -> None:
    """Run ``benchmarks/sandbox_start.py``'s ``sandbox_start_to_exit()`` (else its ``main()``)."""
    path = Path(__file__).with_name("sandbox_start.py")
    if not path.exists():
        print("sandbox start-to-exit: benchmarks/sandbox_start.py is not there; skipped")
        return
    spec = importlib.util.spec_from_file_location("sandbox_start", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = getattr(module, "sandbox_start_to_exit", None) or getattr(module, "main", None)
    if run is None:
        raise ValueError(f"{path} defines neither sandbox_start_to_exit() nor main()")
    run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", choices=("fake", "hf"), default="fake")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="fake engine: time per call")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--no-sandbox", action="store_true", help="skip the sandbox part")
    args = ap.parse_args()

    tokenizer = train_demo_tokenizer()
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    if args.engine == "hf":
        engine = hf_engine(tokenizer)
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=16)
    else:
        engine = ConstantLatencyEngine(tokenizer, args.latency_ms / 1e3)
        sampling = SamplingConfig(max_new_tokens=64)
    session_turns(engine, tokenizer, 2, sampling)  # warm-up: imports, template compile, threads
    served, bare, states = session_turns(engine, tokenizer, args.turns, sampling)
    s, b = statistics.median(served), statistics.median(bare)
    tokens = len(states[-1].input_ids)
    print(
        f"session server, {args.engine} engine, {args.turns} turns, {len(states)} segment(s), "
        f"{tokens} tokens recorded"
    )
    print(
        f"  per turn (median): server {s:.2f} ms  bare engine {b:.2f} ms  "
        f"overhead {s - b:.2f} ms  ratio {s / b if b > 0 else float('inf'):.3f}"
    )
    print(f"  last turn: server {served[-1]:.2f} ms  bare engine {bare[-1]:.2f} ms")
    if not args.no_sandbox:
        sandbox_start_to_exit()


if __name__ == "__main__":
    main()
