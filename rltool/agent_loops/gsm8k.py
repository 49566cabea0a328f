"""The GSM8K loop: one chat-formatted question in, sampled answers out, scored by the
final number.

All prompts of a step, times the group size, go through ONE ``engine.generate`` call.
Design: docs/agent-loops.md#the-gsm8k-loop
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rltool import metric_names as mn
from rltool.agent_loops.base import AgentLoop, LoopContext, register
from rltool.agent_loops.canonical import build_or_fail, check_many
from rltool.agent_loops.evaluation import accuracy_metrics, check_evaluation, failure_metrics
from rltool.config.schema import SamplingConfig
from rltool.data.reasoning_gym import ROW_KEY as RG_KEY
from rltool.engines.base import Generation
from rltool.rewards.gsm8k import RewardResult, extract_answer, gsm8k_reward
from rltool.rewards.reasoning_gym import reasoning_gym_reward
from rltool.rollout.state import RolloutState, Status


def ground_truth_of(task: dict[str, Any]) -> str:
    """The reference answer: the number after ``####`` in the task's answer (a
    reasoning-gym row's answer as it is)."""
    answer = str(task["answer"])
    if RG_KEY in task:
        return answer
    return extract_answer(answer) or answer.strip()


def score_response(text: str, truth: str, task: dict[str, Any] | None = None) -> RewardResult:
    """The reward of one response: a reasoning-gym row's by its generator's
    ``score_answer``, else the final number's; a reward function that raises is an error
    result (``"<Exception>: message"``), so the sample FAILS with it, never scored 0.0."""
    try:
        if task is not None and RG_KEY in task:
            return reasoning_gym_reward(text, task[RG_KEY])
        return gsm8k_reward(text, truth)
    except Exception as exc:  # recorded on the sample and counted, never swallowed
        return RewardResult(None, "error", f"{type(exc).__name__}: {exc}")


def prompt_messages(task: dict[str, Any], system_prompt: str | None) -> list[dict[str, str]]:
    """The row's chat ``messages`` as given (a prompt mapped from chat messages), else
    one user message with its ``question``; ``system_prompt`` goes first unless the
    messages already open with a system message."""
    if task.get("messages"):
        messages = [dict(m) for m in task["messages"]]
    elif "question" in task:
        messages = [{"role": "user", "content": str(task["question"])}]
    else:
        fields = ", ".join(sorted(task))
        raise ValueError(f"gsm8k task has no 'question' or 'messages' field (fields: {fields})")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's token ids as generation gets them: the chat template rendered to text,
    then tokenized without extra specials (the template holds every special token the
    model was trained with)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@register("gsm8k")
class GSM8KLoop(AgentLoop):
    """Single-turn question answering rewarded by the final number (prompt+response)."""

    def __init__(self, ctx: LoopContext, *, system_prompt: str | None = None):
        super().__init__(ctx)
        self.system_prompt = system_prompt
        self._reward_errors = 0  # since the last pop_metrics()

    # --- prompts ------------------------------------------------------------------------

    def prompt_messages(self, task: dict[str, Any]) -> list[dict[str, str]]:
        return prompt_messages(task, self.system_prompt)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return prompt_ids(self.tokenizer, messages)

    @classmethod
    def prompt_lengths(
        cls, records: Sequence[dict[str, Any]], options: Mapping[str, Any], tokenizer: Any
    ) -> list[int]:
        if not records:
            return []
        # prompt_ids's steps, batched: one template call and one tokenizer call for all
        messages = [prompt_messages(r, options.get("system_prompt")) for r in records]
        texts = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def tokenize_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # --- generation ---------------------------------------------------------------------

    def generate_groups(
        self,
        tasks: Sequence[dict[str, Any]],
        n: int,
        group_ids: Sequence[str],
        sampling: SamplingConfig | None = None,
    ) -> list[list[RolloutState]]:
        """``n`` canonical, rewarded samples per task from one batched generate call."""
        self.check_group_args(tasks, n, group_ids)
        messages = [self.prompt_messages(t) for t in tasks]
        prompts = [self.prompt_ids(m) for m in messages]
        repeated = [p for p in prompts for _ in range(n)]  # task-major: task 0 x n, task 1 x n, ...
        gens = self.engine.generate(repeated, sampling or self.sampling)
        if len(gens) != len(repeated):
            raise ValueError(f"engine returned {len(gens)} generations for {len(repeated)} prompts")
        states = [
            self._build(task, msgs, prompt, gens[g * n + i], f"{gid}/{i}", gid)
            for g, (task, msgs, prompt, gid) in enumerate(
                zip(tasks, messages, prompts, group_ids, strict=True)
            )
            for i in range(n)
        ]
        self._check_and_reward(states, [t for t in tasks for _ in range(n)])
        return [states[g * n : (g + 1) * n] for g in range(len(tasks))]

    def _build(
        self,
        task: dict[str, Any],
        messages: list[dict[str, str]],
        prompt: list[int],
        gen: Generation,
        rollout_id: str,
        group_id: str,
    ) -> RolloutState:
        truth = ground_truth_of(task)
        if gen.error is not None:  # the engine's answer broke the contract: ids beyond int64
            return RolloutState(  # too, so none are kept; the error names the bad one
                rollout_id=rollout_id, group_id=group_id, task_name=self.task_name,
                agent_loop=self.name, messages=messages, prompt_ids=list(prompt),
                finish_reason=gen.finish_reason, extra={"ground_truth": truth},
            ).fail(gen.error)  # fmt: skip
        state = RolloutState(
            rollout_id=rollout_id,
            group_id=group_id,
            task_name=self.task_name,
            agent_loop=self.name,
            messages=[*messages, {"role": "assistant", "content": gen.text}],
            prompt_ids=list(prompt),
            response_ids=list(gen.token_ids),
            response_text=gen.text,
            finish_reason=gen.finish_reason,
            response_model_steps=list(gen.model_steps),
            routed_experts=gen.routed_experts,  # [P + R, L, k] aligned with input_ids, or None
            extra={"ground_truth": truth},
        )
        return build_or_fail(state, gen.logprobs, self.tokenize_text)

    def _check_and_reward(
        self, states: list[RolloutState], tasks: Sequence[dict[str, Any]]
    ) -> None:
        """The contract check of the whole batch in one call, then each sample's reward
        (``tasks``: each sample's row)."""
        check_many(states, self.engine.vocab_size)
        for state, task in zip(states, tasks, strict=True):
            if state.status != Status.FAILED:
                truth = state.extra["ground_truth"]
                result = score_response(state.response_text or "", truth, task)
                self._reward(state, result, RG_KEY in task)

    def _reward(
        self, state: RolloutState, result: RewardResult, reasoning_gym: bool = False
    ) -> RolloutState:
        state.reward = {
            "score": result.score,
            "status": result.status,
            "extracted": result.extracted,
            "correct": result.correct,
        }
        if reasoning_gym:  # the generator's own figures, beside the score trained on
            state.reward["extra"] = {"raw_score": result.score, "extracted": result.extracted}
        if result.status == "error":
            self._reward_errors += 1
            state.reward["error"] = result.error
            return state.fail(f"reward: {result.error}")
        state.status = Status.COMPLETED
        return state

    def pop_metrics(self) -> dict[str, float]:
        """Counts since the last call, then reset: ``reward/errors``."""
        out = {mn.REWARD_ERRORS: float(self._reward_errors)}
        self._reward_errors = 0
        return out

    # --- evaluation ---------------------------------------------------------------------

    def evaluate(
        self, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        """Accuracy of one sample per task (greedy when ``sampling.temperature == 0``).

        Each sample is built and rewarded as in training; a FAILED one (a reward error,
        fields that cannot be built) counts as not correct and is counted by reason
        (``eval/failed``, ``eval/failures/<reason>``); when all fail, EvaluationFailed.
        """
        if not tasks:
            raise ValueError("evaluate() needs at least one task")
        messages = [self.prompt_messages(t) for t in tasks]
        prompts = [self.prompt_ids(m) for m in messages]
        gens = self.engine.generate(prompts, sampling)
        kept, self._reward_errors = self._reward_errors, 0  # training counts stay as they were
        samples = [
            self._build(t, m, p, g, f"eval-{i}/0", f"eval-{i}")
            for i, (t, m, p, g) in enumerate(zip(tasks, messages, prompts, gens, strict=True))
        ]
        self._check_and_reward(samples, tasks)
        reward_errors, self._reward_errors = self._reward_errors, kept
        correct = np.array(  # [N]
            [s.status == Status.COMPLETED and bool(s.reward.get("correct")) for s in samples],
            dtype=np.float64,
        )
        lengths = np.array([len(g.token_ids) for g in gens], dtype=np.float64)  # [N]
        truncated = np.array([g.finish_reason == "length" for g in gens], dtype=np.float64)  # [N]
        metrics = {
            **accuracy_metrics(correct),
            mn.EVAL_RESPONSE_LEN_MEAN: float(lengths.mean()),
            mn.EVAL_TRUNCATED_FRAC: float(truncated.mean()),
            mn.EVAL_REWARD_ERRORS: float(reward_errors),
            **failure_metrics(samples),
            mn.EVAL_N: float(len(tasks)),
        }
        return check_evaluation(self.task_name, metrics)
