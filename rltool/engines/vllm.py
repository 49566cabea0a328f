"""``rollout.engine: vllm``: vLLM's ``LLM`` in this process, weights synced in place.

A LoRA run (``model.lora.enabled``) starts the ``LLM`` with ``enable_lora``: a sync sends
the adapters only (``rltool.lora_sync``), loaded as a new ``LoRARequest`` that every
generation names; the base weights never change.

vLLM is imported when the engine is built, never at import time, so the main environment
does without it (``scripts/vllm_env.sh`` builds one that has it). Shape legend:
R = generated tokens of one sequence. Design: docs/engines.md#the-vllm-engine
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rltool.config.schema import ModelConfig, RolloutConfig, SamplingConfig, VLLMConfig
from rltool.engines.chunked import ChunkedEngine, Completion, Request
from rltool.engines.registry import ENGINES
from rltool.engines.vllm_worker import EXTENSION
from rltool.engines.weight_handoff import discard, write_weights_file
from rltool.lora_sync import AdapterPayload, write_adapter
from rltool.models import resolve_model_path

VLLM_MISSING = (
    "rollout.engine: vllm needs vLLM, which this environment lacks ({error}); vLLM pins "
    "its own torch and transformers, so it gets its own environment: build it with "
    "`bash scripts/vllm_env.sh` and run `.venv-vllm/bin/rltool ...`"
)


def import_vllm() -> Any:
    """The ``vllm`` module, or a ValueError that says how to get it."""
    try:
        import vllm
    except ImportError as exc:
        raise ValueError(VLLM_MISSING.format(error=f"{type(exc).__name__}: {exc}")) from exc
    return vllm


# the max_lora_rank values vLLM accepts (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(
            f"model.lora.rank = {rank}: vLLM serves LoRA adapters of rank at most "
            f"{VLLM_LORA_RANKS[-1]}; lower the rank or use rollout.engine: hf"
        )
    return fits[0]


def lora_options(model_cfg: ModelConfig) -> dict[str, Any]:
    """The ``LLM``/``vllm serve`` options of a LoRA run (none without one): one adapter
    at a time, of the recipe's rank (``model.lora.sync: merged``: none, syncs send merged
    weights and vLLM runs its base kernels)."""
    if not model_cfg.lora.enabled or model_cfg.lora.sync == "merged":
        return {}
    return {
        "enable_lora": True,
        "max_lora_rank": vllm_lora_rank(model_cfg.lora.rank),
        "max_loras": 1,
    }


def llm_options(cfg: VLLMConfig, model_cfg: ModelConfig, path: Path) -> dict[str, Any]:
    """``LLM(**options)`` for ``rollout.vllm`` (its values checked when the recipe loaded)."""
    return lora_options(model_cfg) | {
        "model": str(path),
        "dtype": cfg.dtype or model_cfg.dtype,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "enforce_eager": cfg.enforce_eager,
        "enable_sleep_mode": cfg.enable_sleep_mode,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "max_model_len": cfg.max_model_len,
        "seed": cfg.seed,
        "enable_prefix_caching": True,  # a group's samples share their prompt's KV blocks
        "generation_config": "vllm",  # every sampling knob comes from the recipe
        "logprobs_mode": "processed_logprobs",  # made rltool's by rltool_tempered_logprobs
        "worker_extension_cls": EXTENSION,
    }


def sampling_params(vllm: Any, s: SamplingConfig, n: int, max_tokens: int, eos: list[int]) -> Any:
    """vLLM's SamplingParams for ``s`` (every knob explicit, as in the HF engine), ``n``
    samples of at most ``max_tokens`` tokens, the sampled token's logprob returned."""
    return vllm.SamplingParams(
        n=n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,  # 0 = off in both
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        max_tokens=max_tokens,
        stop=list(s.stop) or None,
        stop_token_ids=eos,
        logprobs=0,  # the sampled token's only
        skip_special_tokens=True,
    )


class VLLMEngine(ChunkedEngine):
    """vLLM's ``LLM`` generating from token ids; holds its own copy of the weights.

    Weights go in through a safetensors file that ``RltoolWorkerExtension`` reloads in
    place. ``chunk_tokens``: generations run in calls of that many tokens, and weights
    that arrived meanwhile are applied between calls (partial rollouts). ``max_lora_rank``
    (the ``LLM`` was started with ``enable_lora``): syncs send adapters, loaded as a
    ``LoRARequest`` with a new id each time (vLLM caches adapters by id).
    """

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        model: Any = None,
        model_step: int = 0,
        chunk_tokens: int | None = None,
        sleep_mode: bool = False,
        max_lora_rank: int | None = None,
    ):
        super().__init__(tokenizer, model, chunk_tokens, model_step)
        self.vllm = import_vllm()
        self.max_lora_rank = max_lora_rank
        self.takes_adapters = max_lora_rank is not None
        self._lora: Any = None  # the LoRARequest every generation names; None: the base
        self._lora_path: Path | None = None
        self._lora_ids = itertools.count(1)  # vLLM's adapter ids start at 1
        self.llm = llm
        self.sleep_mode = sleep_mode
        self._asleep = False
        self._dir = Path(tempfile.mkdtemp(prefix="rltool-vllm-weights-"))
        self._files = itertools.count()
        llm.collective_rpc("rltool_tempered_logprobs")

    def _write_weights(self, state_dict: Mapping[str, torch.Tensor], model_step: int) -> Path:
        """A file in this engine's temporary folder; a tied LM head goes as the embedding
        (vLLM ties it again on load)."""
        path = self._dir / f"weights_{next(self._files)}_step_{model_step}.safetensors"
        return write_weights_file(state_dict, path, drop_tied=True)

    def _write_adapter(self, payload: AdapterPayload, model_step: int) -> Path:
        """peft's folder in this engine's temporary folder."""
        if not self.takes_adapters:
            return super()._write_adapter(payload, model_step)
        if payload.rank > self.max_lora_rank:
            raise ValueError(
                f"a LoRA adapter of rank {payload.rank} for a vLLM engine started with "
                f"max_lora_rank {self.max_lora_rank}: model.lora.rank must match the run's"
            )
        return write_adapter(payload, self._dir / f"adapter_{next(self._files)}_step_{model_step}")

    def _load_file(self, path: Path, step: int) -> None:
        """Load an adapter folder, or reload the weights file ``path`` in every worker,
        stamp the step; drop the prefix cache (its KV blocks were computed with the old
        weights)."""
        self._wake()
        if path.is_dir():
            self._load_adapter(path, step)
        else:
            steps = self.llm.collective_rpc("rltool_load_weights", args=(str(path), step))
            assert set(steps) == {step}, f"workers loaded steps {steps}, expected {step}"
            self._drop_adapter()  # the new full weights replace base + adapter
            path.unlink()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update")

    def _load_adapter(self, path: Path, step: int) -> None:
        """Add the adapter at ``path`` under a new id (the old id would be served from
        vLLM's cache), then remove the previous one and its folder (memory stays bounded)."""
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        request = LoRARequest(f"rltool-step{step}-{lora_id}", lora_id, str(path))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter at {path}")
        self._drop_adapter()
        self._lora, self._lora_path = request, path

    def _drop_adapter(self) -> None:
        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
            discard(self._lora_path)
            self._lora, self._lora_path = None, None

    def _start_generate(self) -> None:
        self._wake()

    def _wake(self) -> None:
        if self._asleep:  # weights and KV cache back on the device
            self.llm.wake_up()
            self._asleep = False

    def _end_generate(self) -> None:
        if self.sleep_mode:  # the trainer trains next: give it the memory
            self.llm.sleep(level=1)
            self._asleep = True

    def _complete(
        self, requests: Sequence[Request], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """One ``LLM.generate`` per (n, max_tokens) (SamplingParams carry both); a group's
        prompt goes once with ``n`` samples (one prefill, shared KV blocks)."""
        out: list[list[Completion]] = [[] for _ in requests]
        batches: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(requests):
            batches.setdefault((r.n, r.max_tokens), []).append(i)
        for (n, max_tokens), indices in batches.items():
            params = sampling_params(self.vllm, sampling, n, max_tokens, self.eos)
            prompts = [{"prompt_token_ids": list(requests[i].context)} for i in indices]
            answers = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)
            for i, answer in zip(indices, answers, strict=True):
                out[i] = [_completion(c) for c in answer.outputs]
        return out

    def shutdown(self) -> None:
        """Stop vLLM's engine core process and remove the weight files."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)


def _completion(output: Any) -> Completion:
    """The generated token ids [R], each one's logprob [R] and whether it stopped (EOS or
    a stop string; not the token budget) of a vLLM CompletionOutput."""
    ids = list(output.token_ids)
    assert output.logprobs is not None and len(output.logprobs) == len(ids)
    lps = [float(lp[t].logprob) for lp, t in zip(output.logprobs, ids, strict=True)]
    return Completion(ids, lps, output.finish_reason == "stop")


@ENGINES.register("vllm")
def build_vllm_engine(
    rollout: RolloutConfig, model_cfg: ModelConfig, model: Any, tokenizer: Any
) -> VLLMEngine:
    """``rollout.engine: vllm``: an ``LLM`` on ``model.path``; ``model`` (the trainer's, or
    None) is what ``sync_weights`` pushes."""
    options = llm_options(rollout.vllm, model_cfg, resolve_model_path(model_cfg.path))
    vllm = import_vllm()
    if rollout.vllm.enable_sleep_mode:
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            raise ValueError(
                "rollout.vllm.enable_sleep_mode: vLLM's sleep mode needs a GPU "
                f"(this platform: {type(current_platform).__name__}); set it to false"
            )
    llm = vllm.LLM(**options)
    return VLLMEngine(
        llm,
        tokenizer,
        model=model,
        chunk_tokens=rollout.chunk_tokens,
        sleep_mode=rollout.vllm.enable_sleep_mode,
        max_lora_rank=options.get("max_lora_rank"),
    )
