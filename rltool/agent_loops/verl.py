"""The ``verl`` loop: runs agent loops written for verl's agent-loop interface.

``options.loop_class`` names the class by import path; each trajectory gets a fresh loop
object, its output becomes a canonical RolloutState (``rltool.verl_compat``).
Design (options, rewards, failures): docs/agent-loops.md#the-verl-loop
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rltool import metric_names as mn
from rltool.agent_loops.base import AgentLoop, LoopContext, register
from rltool.agent_loops.evaluation import accuracy_metrics, check_evaluation, failure_metrics
from rltool.agent_loops.gsm8k import ground_truth_of
from rltool.config.schema import SamplingConfig
from rltool.engines.batcher import AsyncGenerationBatcher
from rltool.rewards.gsm8k import gsm8k_reward
from rltool.rollout.state import RolloutState, Status
from rltool.verl_compat.config import (
    ConfigWrap,
    ToolListWrap,
    load_loop_class,
    load_tools,
    loop_class_problems,
    trainer_config,
)
from rltool.verl_compat.convert import canonical_fields
from rltool.verl_compat.server import TrajectoryServer, sampling_params_of

JUDGERS = ("gsm8k",)
# evaluate() counts a task solved at this score (rule-based scorers give 1.0 when right)
SOLVED_SCORE = 1.0


@dataclass(slots=True)
class _Trajectory:
    """What one ``run`` left behind: its output or its error, and its server's record."""

    output: Any
    server: TrajectoryServer
    error: str | None


def _plain(value: Any) -> Any:
    """``value`` as plain JSON data (numpy and torch values become lists and numbers)."""

    def default(o: Any) -> Any:
        return o.tolist() if hasattr(o, "tolist") else repr(o)

    return json.loads(json.dumps(value, default=default))


def last_turn(mask: Sequence[int]) -> slice:
    """The last contiguous run of generated positions (mask 1): the model's final turn."""
    idx = np.flatnonzero(np.asarray(mask) == 1)  # [G]
    if idx.size == 0:
        return slice(0, 0)
    breaks = np.flatnonzero(np.diff(idx) > 1)  # [turns - 1]
    start = idx[breaks[-1] + 1] if breaks.size else idx[0]
    return slice(int(start), int(idx[-1]) + 1)


@register("verl")
class VerlAgentLoop(AgentLoop):
    """Adapter: verl-style agent loop classes, run on rltool's engine, canonical samples out."""

    def __init__(
        self,
        ctx: LoopContext,
        *,
        loop_class: str,
        system_prompt: str | None = None,
        reward: str | None = None,
        prompt_length: int = 1024,
        response_length: int | None = None,
        multi_turn: dict[str, Any] | None = None,
        hf_model_type: str | None = None,
        config: dict[str, Any] | None = None,
        loop_kwargs: dict[str, Any] | None = None,
    ):
        if reward is not None and reward not in JUDGERS:
            raise ValueError(
                f"agent_loop.options.reward {reward!r} is not a judger; known: {', '.join(JUDGERS)}"
            )
        super().__init__(ctx)
        self.loop_cls = load_loop_class(loop_class)
        self.system_prompt = system_prompt
        self.reward = reward
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.multi_turn = dict(multi_turn or {})
        self.overrides = dict(config or {})
        self.loop_kwargs = dict(loop_kwargs or {})
        model_config = getattr(getattr(ctx.engine, "model", None), "config", None)
        self.hf_model_type = hf_model_type or getattr(model_config, "model_type", None)
        # loaded once, shared by every trajectory (as verl's worker does)
        self.tools = load_tools(
            self.multi_turn.get("tool_config_path"), self.multi_turn.get("function_tool_path")
        )
        self._token_text: dict[int, str] = {}
        self._metrics = {
            mn.REWARD_ERRORS: 0,
            "verl/failed": 0,
            "verl/engine_calls": 0,
            "verl/turns": 0,
        }
        self._trajectories = 0

    @classmethod
    def preflight(cls, options: Mapping[str, Any]) -> list[str]:
        """verl installed when the options name verl's own loop class or verl tool configs;
        any other loop class importable (it runs without verl)."""
        return loop_class_problems(options.get("loop_class"), options.get("multi_turn"))

    # --- tasks ------------------------------------------------------------------------

    def raw_prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """A task's chat messages: ``messages`` (a mapped row), ``raw_prompt``/``prompt``
        (verl's dataset) or ``question``."""
        for key in ("messages", "raw_prompt", "prompt"):
            if isinstance(task.get(key), list):
                return [dict(m) for m in task[key]]
        if "question" not in task:
            fields = ", ".join(sorted(task))
            raise ValueError(
                "verl task has no 'raw_prompt', 'prompt' (chat messages) or 'question' field "
                f"(fields: {fields})"
            )
        messages = [{"role": "user", "content": str(task["question"])}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    @staticmethod
    def ground_truth(task: dict[str, Any]) -> str | None:
        if "answer" in task:
            return ground_truth_of(task)
        reward_model = task.get("reward_model")
        if isinstance(reward_model, dict) and "ground_truth" in reward_model:
            return str(reward_model["ground_truth"])
        return None

    def token_text(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return self._token_text[token_id]

    # --- running trajectories -----------------------------------------------------------

    def generate_groups(
        self,
        tasks: Sequence[dict[str, Any]],
        n: int,
        group_ids: Sequence[str],
        sampling: SamplingConfig | None = None,
    ) -> list[list[RolloutState]]:
        """``n`` canonical, rewarded samples per task; all trajectories run concurrently."""
        self.check_group_args(tasks, n, group_ids)
        sampling = sampling or self.sampling
        messages = [self.raw_prompt(t) for t in tasks]
        repeated = [m for m in messages for _ in range(n)]  # task-major: task 0 x n, task 1 x n
        runs = asyncio.run(self._run_all(repeated, tasks, n, sampling))
        return [
            [self._sample(task, msgs, runs[g * n + i], f"{gid}/{i}", gid) for i in range(n)]
            for g, (task, msgs, gid) in enumerate(zip(tasks, messages, group_ids, strict=True))
        ]

    def _response_length(self, sampling: SamplingConfig) -> int:
        return self.response_length or sampling.max_new_tokens

    async def _run_all(
        self,
        messages: list[list[dict[str, Any]]],
        tasks: Sequence[dict[str, Any]],
        n: int,
        sampling: SamplingConfig,
    ) -> list[_Trajectory]:
        response_length = self._response_length(sampling)
        config = trainer_config(
            prompt_length=self.prompt_length,
            response_length=response_length,
            sampling=sampling,
            multi_turn=self.multi_turn,
            overrides=self.overrides,
        )
        batcher = AsyncGenerationBatcher(self.engine, self._decode)
        params = sampling_params_of(sampling)
        batcher.add_trajectories(len(messages))
        runs = await asyncio.gather(
            *(
                self._run_one(batcher, config, params, msgs, tasks[k // n], response_length)
                for k, msgs in enumerate(messages)
            )
        )
        self._metrics["verl/engine_calls"] += batcher.calls
        return list(runs)

    async def _run_one(
        self,
        batcher: AsyncGenerationBatcher,
        config: Any,
        params: dict[str, Any],
        messages: list[dict[str, Any]],
        task: dict[str, Any],
        response_length: int,
    ) -> _Trajectory:
        server = TrajectoryServer(batcher, self.prompt_length, response_length, self.token_text)
        try:
            loop = self.loop_cls(
                trainer_config=ConfigWrap(config),
                server_manager=server,
                tokenizer=self.tokenizer,
                processor=None,
                hf_model_type=self.hf_model_type,
                dataset_cls=None,
                data_config=ConfigWrap(config.data),
                tools=ToolListWrap(self.tools),
                **self.loop_kwargs,
            )
            output = await loop.run(dict(params), **{**task, "raw_prompt": messages})
        except Exception as exc:  # the trajectory fails alone; the reason goes into its sample
            error = f"{self.loop_cls.__name__}.run raised {type(exc).__name__}: {exc}"
            return _Trajectory(None, server, error)
        finally:
            batcher.trajectory_done()
        return _Trajectory(output, server, None)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # --- trajectories to samples --------------------------------------------------------

    def _sample(
        self,
        task: dict[str, Any],
        messages: list[dict[str, Any]],
        run: _Trajectory,
        rollout_id: str,
        group_id: str,
    ) -> RolloutState:
        self._trajectories += 1
        truth = self.ground_truth(task)
        state = RolloutState(
            rollout_id=rollout_id,
            group_id=group_id,
            task_name=self.task_name,
            agent_loop=self.name,
            messages=messages,
            prompt_ids=[],
            extra={} if truth is None else {"ground_truth": truth},
        )
        if run.error is not None:
            self._metrics["verl/failed"] += 1
            return state.fail(f"verl: {run.error}")
        out = run.output
        try:  # AgentLoopOutput's required fields, then its optional ones with verl's defaults
            mask = out.response_mask
            fields = canonical_fields(
                out.prompt_ids,
                out.response_ids,
                mask,
                getattr(out, "response_logprobs", None),
                run.server.model_steps,
                default_step=self.engine.model_step,
            )
            num_turns = int(getattr(out, "num_turns", 0))
            state.routed_experts = run.server.routed_experts(fields.input_ids)  # [T, L, k]
        except (AttributeError, ValueError, TypeError) as exc:
            self._metrics["verl/failed"] += 1
            return state.fail(f"verl: bad loop output ({exc})")
        cut = len(fields.response_ids) >= run.server.response_length
        state.prompt_ids = fields.prompt_ids
        state.response_ids = fields.response_ids
        state.input_ids = fields.input_ids
        state.labels = fields.labels
        state.logprobs = fields.logprobs
        state.response_model_steps = fields.response_model_steps
        state.response_text = self._decode(fields.response_ids)
        state.finish_reason = "length" if cut else run.server.finish_reason
        state.extra = {
            **state.extra,
            **_plain(dict(getattr(out, "extra_fields", None) or {})),
            "num_turns": num_turns,
        }
        self._metrics["verl/turns"] += num_turns
        state = self.check_train_fields(state)
        if state.status == Status.FAILED:
            self._metrics["verl/failed"] += 1
            return state
        final_text = self._decode(fields.response_ids[last_turn(mask)])
        return self._reward(state, getattr(out, "reward_score", None), final_text, truth)

    def _reward(
        self, state: RolloutState, reward_score: Any, final_text: str, truth: str | None
    ) -> RolloutState:
        if reward_score is not None:
            score = float(reward_score)
            if not math.isfinite(score):
                self._metrics[mn.REWARD_ERRORS] += 1
                return state.fail(f"reward: the verl loop's reward_score is {score}")
            state.reward = {"score": score, "source": "loop"}
        elif self.reward is None:
            self._metrics[mn.REWARD_ERRORS] += 1
            return state.fail(
                "reward: the verl loop set no reward_score and agent_loop.options.reward names no "
                f"judger (known: {', '.join(JUDGERS)})"
            )
        elif truth is None:
            self._metrics[mn.REWARD_ERRORS] += 1
            return state.fail(
                "reward: the task has no 'answer' or reward_model.ground_truth to judge against"
            )
        else:
            result = gsm8k_reward(final_text, truth)
            state.reward = {
                "score": result.score,
                "source": self.reward,
                "status": result.status,
                "extracted": result.extracted,
                "correct": result.correct,
            }
            if result.status == "error":
                self._metrics[mn.REWARD_ERRORS] += 1
                state.reward["error"] = result.error
                return state.fail(f"reward: {result.error}")
        state.status = Status.COMPLETED
        return state

    def pop_metrics(self) -> dict[str, float]:
        """Counts since the last call, then reset: reward errors, failed trajectories,
        engine calls made and the mean number of turns per trajectory."""
        out = {k: float(v) for k, v in self._metrics.items() if k != "verl/turns"}
        out["verl/turns_mean"] = self._metrics["verl/turns"] / max(self._trajectories, 1)
        self._metrics = dict.fromkeys(self._metrics, 0)
        self._trajectories = 0
        return out

    # --- evaluation ---------------------------------------------------------------------

    def evaluate(
        self, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        """One trajectory per task (greedy when ``sampling.temperature == 0``).

        ``eval/accuracy`` is the fraction of tasks whose score reaches 1.0; a failed
        trajectory counts as not solved and is counted by reason (``eval/failed``,
        ``eval/failures/<reason>``; reward errors also in ``eval/reward_errors``); when
        all fail, EvaluationFailed. The training counters of ``pop_metrics`` stay as they were.
        """
        if not tasks:
            raise ValueError("evaluate() needs at least one task")
        kept = dict(self._metrics), self._trajectories
        self._metrics = dict.fromkeys(self._metrics, 0)
        group_ids = [f"eval-{i}" for i in range(len(tasks))]
        samples = [g[0] for g in self.generate_groups(tasks, 1, group_ids, sampling)]
        reward_errors = self._metrics[mn.REWARD_ERRORS]
        self._metrics, self._trajectories = kept
        ok = [s.status == Status.COMPLETED for s in samples]
        scores = [s.score if o else None for o, s in zip(ok, samples, strict=True)]
        solved = np.array([x is not None and x >= SOLVED_SCORE for x in scores])  # [N]
        lengths = np.array(
            [0 if s.response_ids is None else len(s.response_ids) for s in samples], np.float64
        )  # [N]
        truncated = np.array([s.finish_reason == "length" for s in samples], np.float64)  # [N]
        metrics = {
            **accuracy_metrics(solved.astype(np.float64)),
            mn.EVAL_RESPONSE_LEN_MEAN: float(lengths.mean()),
            mn.EVAL_TRUNCATED_FRAC: float(truncated.mean()),
            mn.EVAL_REWARD_ERRORS: float(reward_errors),
            **failure_metrics(samples),
            mn.EVAL_N: float(len(tasks)),
        }
        return check_evaluation(self.task_name, metrics)
