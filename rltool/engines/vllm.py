"""``rollout.engine: vllm``: vLLM's ``LLM`` in this process, weights synced in place.

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
from rltool.engines.base import Generation, RolloutEngine
from rltool.engines.registry import ENGINES
from rltool.engines.vllm_worker import EXTENSION
from rltool.engines.weight_handoff import PendingWeights, write_weights_file
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


def llm_options(cfg: VLLMConfig, model_cfg: ModelConfig, path: Path) -> dict[str, Any]:
    """``LLM(**options)`` for ``rollout.vllm`` (its values checked when the recipe loaded)."""
    return {
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


def eos_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (as ``HFEngine``)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    cfg_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += cfg_eos if isinstance(cfg_eos, list) else [] if cfg_eos is None else [cfg_eos]
    return sorted(set(ids))


def first_stop(tokenizer: Any, tokens: list[int], stops: Sequence[str], start: int) -> int | None:
    """Length of the shortest prefix of ``tokens`` (longer than ``start``) whose text holds a
    stop string, or None: a stop string split across two calls (partial rollouts)."""
    if not stops or not any(s in tokenizer.decode(tokens) for s in stops):
        return None
    for n in range(start + 1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:n]) for s in stops):
            return n
    return None


class VLLMEngine(RolloutEngine):
    """vLLM's ``LLM`` generating from token ids; holds its own copy of the weights.

    Weights go in through a safetensors file that ``RltoolWorkerExtension`` reloads in
    place. ``chunk_tokens``: generations run in calls of that many tokens, and weights
    that arrived meanwhile are applied between calls (partial rollouts).
    """

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        model: Any = None,
        model_step: int = 0,
        chunk_tokens: int | None = None,
        sleep_mode: bool = False,
    ):
        self.vllm = import_vllm()
        self.llm = llm
        self.tokenizer = tokenizer
        self.model = model  # the trainer's model (sync_weights pushes its weights), or None
        self.chunk_tokens = chunk_tokens
        self.sleep_mode = sleep_mode
        self.eos = eos_ids(tokenizer, model)
        self._asleep = False
        self._dir = Path(tempfile.mkdtemp(prefix="rltool-vllm-weights-"))
        self._weights = PendingWeights(self._load, "VLLMEngine", model_step)
        self._files = itertools.count()
        llm.collective_rpc("rltool_tempered_logprobs")

    @property
    def model_step(self) -> int:
        return self._weights.step

    @property
    def weights_waiting(self) -> bool:
        return self._weights.waiting

    def sync_weights(self, model_step: int) -> None:
        """Push the trainer's model (the one this engine was built with) as ``model_step``:
        vLLM holds its own copy, so a shared-model sync copies too."""
        if self.model is None:
            raise ValueError("VLLMEngine.sync_weights needs the trainer's model; use load_weights")
        self.load_weights(self.model.state_dict(), model_step)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], model_step: int) -> None:
        """Write ``state_dict`` to a file now; vLLM reloads it at once when idle, else at the
        next pause point or when the running call ends (a later call replaces it)."""
        self._weights.check(model_step)
        path = self._dir / f"weights_{next(self._files)}_step_{model_step}.safetensors"
        self._weights.offer(write_weights_file(state_dict, path, drop_tied=True), model_step)

    def _load(self, path: Path, step: int) -> None:
        """Reload ``path`` in every worker, stamp the step, drop the prefix cache (its KV
        blocks were computed with the old weights)."""
        self._wake()
        steps = self.llm.collective_rpc("rltool_load_weights", args=(str(path), step))
        assert set(steps) == {step}, f"workers loaded steps {steps}, expected {step}"
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update")
        path.unlink()

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _sleep(self) -> None:
        if self.sleep_mode:  # the trainer trains next: give it the memory
            self.llm.sleep(level=1)
            self._asleep = True

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        with self._weights.generating(start=self._wake, end=self._sleep):
            return self._generate(prompts, sampling)

    def _generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        budget = sampling.max_new_tokens
        chunk = budget if self.chunk_tokens is None else min(self.chunk_tokens, budget)
        tokens, logprobs, finished = self._first_call(prompts, sampling, chunk)
        steps = [[self.model_step] * len(t) for t in tokens]
        while True:  # partial rollouts: the unfinished rows go on, with new weights if any
            active = [r for r in range(len(prompts)) if not finished[r] and len(tokens[r]) < budget]
            if not active:
                break
            self._weights.apply_waiting()
            contexts = [[*prompts[r], *tokens[r]] for r in active]
            step = min(chunk, budget - len(tokens[active[0]]))
            params = sampling_params(self.vllm, sampling, 1, step, self.eos)
            outs = self.llm.generate(_token_prompts(contexts), params, use_tqdm=False)
            for r, out in zip(active, outs, strict=True):
                new, lps, stopped = _tokens_and_logprobs(out.outputs[0])
                done = len(tokens[r])
                tokens[r] += new
                logprobs[r] += lps
                steps[r] += [self.model_step] * len(new)
                cut = first_stop(self.tokenizer, tokens[r], sampling.stop, done)
                if cut is not None:
                    del tokens[r][cut:], logprobs[r][cut:], steps[r][cut:]
                finished[r] = stopped or cut is not None
        return [
            Generation(
                token_ids=tokens[r],
                logprobs=logprobs[r],
                model_steps=steps[r],
                finish_reason="stop" if finished[r] else "length",
                text=self.tokenizer.decode(tokens[r], skip_special_tokens=True),
            )
            for r in range(len(prompts))
        ]

    def _first_call(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, chunk: int
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """(tokens, logprobs, stopped) per row; each distinct prompt sent once with ``n`` =
        its repeats (one prefill, shared KV blocks)."""
        rows_of: dict[tuple[int, ...], list[int]] = {}
        for r, p in enumerate(prompts):
            rows_of.setdefault(tuple(p), []).append(r)
        distinct = list(rows_of)
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        stopped = [False] * len(prompts)
        by_n: dict[int, list[tuple[int, ...]]] = {}  # SamplingParams are per n
        for p in distinct:
            by_n.setdefault(len(rows_of[p]), []).append(p)
        for n, group in by_n.items():
            params = sampling_params(self.vllm, sampling, n, chunk, self.eos)
            outs = self.llm.generate(_token_prompts(group), params, use_tqdm=False)
            for p, out in zip(group, outs, strict=True):
                for r, completion in zip(rows_of[p], out.outputs, strict=True):
                    tokens[r], logprobs[r], stopped[r] = _tokens_and_logprobs(completion)
        return tokens, logprobs, stopped

    def shutdown(self) -> None:
        """Stop vLLM's engine core process and remove the weight files."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)


def _token_prompts(prompts: Sequence[Sequence[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": list(p)} for p in prompts]


def _tokens_and_logprobs(completion: Any) -> tuple[list[int], list[float], bool]:
    """The generated token ids [R], each one's logprob [R] and whether it stopped (EOS or
    a stop string; not the token budget) from a CompletionOutput."""
    ids = list(completion.token_ids)
    assert completion.logprobs is not None and len(completion.logprobs) == len(ids)
    lps = [float(lp[t].logprob) for lp, t in zip(completion.logprobs, ids, strict=True)]
    return ids, lps, completion.finish_reason == "stop"


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
    )
