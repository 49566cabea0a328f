"""The server manager a verl-style agent loop calls, backed by rltool's rollout engine.

Design: docs/agent-loops.md#the-server-manager
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation
from rltool.engines.batcher import AsyncGenerationBatcher
from rltool.rollout.routing import stitch_turns

# keys whose value only matters when it differs from this neutral value
_NEUTRAL = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "ignore_eos": False,
    "n": 1,
}
_HANDLED = {
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "logprobs",
}
_FINISH = {"stop": "completed", "length": "length"}  # rltool finish_reason -> verl stop_reason


@dataclass(slots=True)
class TokenOutput:
    """What verl's ``LLMServerClient.generate`` returns, attribute for attribute."""

    token_ids: list[int]  # [R] generated tokens
    log_probs: list[float] | None = None  # [R]
    routed_experts: Any = None
    stop_reason: str | None = None  # "completed" | "length"
    num_preempted: int | None = 0
    extra_fields: dict[str, Any] = field(default_factory=dict)


def to_sampling(
    params: dict[str, Any],
    budget: int,
    token_text: Callable[[int], str],
) -> SamplingConfig:
    """A SamplingConfig from verl's sampling params.

    ``budget`` is the token limit when the params give none (``max_tokens`` /
    ``max_new_tokens``); ``token_text`` gives the text of a ``stop_token_ids``
    entry, which stops generation as a stop string (the engine knows no stop ids).
    """
    for key, neutral in _NEUTRAL.items():
        if key in params and params[key] != neutral:
            raise ValueError(
                f"sampling_params[{key!r}] = {params[key]!r} is not supported by rltool's engine "
                f"(only {neutral!r})"
            )
    unknown = sorted(set(params) - _HANDLED - set(_NEUTRAL))
    if unknown:
        raise ValueError(
            f"sampling_params {unknown} are not supported by rltool's engine; supported: "
            f"{sorted(_HANDLED | set(_NEUTRAL))}"
        )
    top_k = params.get("top_k")
    limit = params.get("max_tokens", params.get("max_new_tokens"))
    stop = params.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    stop += [token_text(int(t)) for t in params.get("stop_token_ids") or []]
    return SamplingConfig(
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=0 if top_k is None or top_k < 0 else int(top_k),  # verl/vLLM: -1 = off
        max_new_tokens=max(1, int(budget if limit is None else limit)),
        stop=sorted(set(stop)),
    )


class TrajectoryServer:
    """The ``server_manager`` of one trajectory: generates through the shared batcher.

    Without an explicit token limit a turn gets what verl's vLLM server gives it:
    ``min(response_length, prompt_length + response_length - len(prompt_ids))``,
    at least 1.
    """

    def __init__(
        self,
        batcher: AsyncGenerationBatcher,
        prompt_length: int,
        response_length: int,
        token_text: Callable[[int], str],
    ):
        self.batcher = batcher
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.token_text = token_text
        self.generations: list[Generation] = []  # in order, one per generate call
        self.prompts: list[list[int]] = []  # [C] the context of each generate call

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise ValueError(
                "rltool's engine is text-only: this request carries images, video or audio"
            )
        prompt = [int(t) for t in prompt_ids]
        budget = min(self.response_length, self.prompt_length + self.response_length - len(prompt))
        sampling = to_sampling(sampling_params, budget, self.token_text)
        gen = await self.batcher.generate(prompt, sampling)
        self.generations.append(gen)
        self.prompts.append(prompt)
        return TokenOutput(
            token_ids=list(gen.token_ids),
            log_probs=list(gen.logprobs),
            stop_reason=_FINISH.get(gen.finish_reason, gen.finish_reason),
        )

    @property
    def model_steps(self) -> list[int]:
        """Policy version of every generated token, in generation order."""
        return [s for g in self.generations for s in g.model_steps]

    def routed_experts(self, input_ids: np.ndarray) -> np.ndarray | None:
        """The trajectory's MoE routing [T, L, k] aligned with its ``input_ids`` [T] (each
        turn's routing stitched as its tokens are: ``stitch_turns``), or None when the engine
        recorded none. A ValueError when a turn's context is not a prefix of ``input_ids``
        (the loop re-rendered the conversation: its routing cannot be placed)."""
        routed = [g.routed_experts for g in self.generations]
        if not routed or all(r is None for r in routed):
            return None
        if any(r is None for r in routed):
            missing = sum(r is None for r in routed)
            raise ValueError(f"the engine recorded MoE routing for all but {missing} turns")
        for k, prompt in enumerate(self.prompts):
            n = min(len(prompt), len(input_ids))
            if not np.array_equal(np.asarray(prompt[:n]), input_ids[:n]):
                raise ValueError(
                    f"turn {k}'s prompt is not a prefix of the trajectory's tokens, so its MoE "
                    "routing cannot be placed; the loop must extend its token ids turn by turn"
                )
        return stitch_turns(len(input_ids), routed)  # [T, L, k]

    @property
    def finish_reason(self) -> str | None:
        return self.generations[-1].finish_reason if self.generations else None


def sampling_params_of(sampling: SamplingConfig) -> dict[str, Any]:
    """verl's sampling params for an rltool SamplingConfig (what verl's worker passes to ``run``).

    ``max_new_tokens`` is not passed: as in verl, a loop's budget is the rollout
    config's ``response_length``.
    """
    params = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "repetition_penalty": 1.0,
        "logprobs": True,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    return params
