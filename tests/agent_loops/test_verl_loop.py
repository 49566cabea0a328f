"""The ``verl`` agent loop, without verl: a duck-typed verl-style loop through the adapter.

``ToolCallLoop`` below is written against verl 0.9's agent-loop interface (its
constructor keywords, ``rollout`` config keys, ``server_manager.generate`` and
the ``AgentLoopOutput`` attributes) the way verl's ToolAgentLoop uses them: a
first turn, a tool response appended with mask 0, a second turn. verl's own
loops run through the same adapter in tests/verl_env/ (a separate environment).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rltool.agent_loops.base import AGENT_LOOPS, LoopContext
from rltool.agent_loops.evaluation import EvaluationFailed
from rltool.agent_loops.verl import VerlAgentLoop, last_turn
from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation, RolloutEngine
from rltool.rollout.contract import check_group, check_sample, errors
from rltool.rollout.state import IGNORE_INDEX, Status
from rltool.verl_compat.config import resolve_tool_path, trainer_config
from rltool.verl_compat.convert import canonical_fields
from rltool.verl_compat.server import sampling_params_of, to_sampling

WORDS = ["<pad>", "<eos>", "<s>", "user", "assistant", "tool", ":", "what", "is", "2", "+", "3",
         "?", "call", "add", "5", "####", "boom", "bad", "judge", "7"]  # fmt: skip
VOCAB = {w: i for i, w in enumerate(WORDS)}
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def ids(text: str) -> list[int]:
    return [VOCAB[w] for w in text.split()]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", chat_template=TEMPLATE
    )


# --- a verl-style loop, duck-typed ------------------------------------------------------


@dataclass
class Output:
    """The attributes of verl's AgentLoopOutput that the adapter reads."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None
    reward_score: float | None
    num_turns: int
    extra_fields: dict[str, Any] = field(default_factory=dict)


TOOL_TOKENS = ids("<s> tool : 5 <eos> <s> assistant :")  # tool response + next generation prompt


class ToolCallLoop:
    """Turn 1 asks the tool; its answer is appended (mask 0); turn 2 answers."""

    def __init__(
        self,
        trainer_config,
        server_manager,
        tokenizer,
        processor,
        dataset_cls,
        data_config,
        hf_model_type=None,
        tools=None,
        score: float | None = 1.0,
        **kwargs,
    ):
        self.rollout = trainer_config.config.actor_rollout_ref.rollout
        self.server = server_manager
        self.tokenizer = tokenizer
        self.chat_kwargs = data_config.config.get("apply_chat_template_kwargs", {})
        self.tools = tools.tools
        self.score = score

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> Output:
        messages = kwargs["raw_prompt"]
        if "boom" in messages[-1]["content"]:
            raise RuntimeError("tool server unreachable")
        prompt = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt = list(prompt)
        response, mask, logprobs = [], [], []
        for turn in range(2):
            out = await self.server.generate(
                request_id="r", prompt_ids=prompt + response, sampling_params=sampling_params
            )
            response += out.token_ids
            mask += [1] * len(out.token_ids)
            logprobs += out.log_probs
            if turn == 0:
                response += TOOL_TOKENS
                mask += [0] * len(TOOL_TOKENS)
                logprobs += [0.0] * len(TOOL_TOKENS)
        if "bad" in messages[-1]["content"]:
            mask = mask[:-1]  # one entry short: the adapter must refuse it
        n = self.rollout.response_length
        return Output(
            prompt_ids=prompt,
            response_ids=response[:n],
            response_mask=mask[:n],
            response_logprobs=logprobs[:n],
            reward_score=self.score,
            num_turns=4,
            extra_fields={"turn_scores": [], "tool_rewards": [0.5], "steps": np.int64(2)},
        )


LOOP_PATH = f"{__name__}.ToolCallLoop"


class ScriptedEngine(RolloutEngine):
    """Turn 1 (no tool answer in the prompt) calls the tool; turn 2 answers "#### 5".

    Every generate call bumps the model step, as a weight sync between turns would.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], SamplingConfig]] = []
        self.step = 3

    @property
    def model_step(self) -> int:
        return self.step

    def sync_weights(self, model_step: int) -> None:
        self.step = model_step

    def load_weights(self, state_dict, model_step: int) -> None:
        self.step = model_step

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        self.calls.append(([list(p) for p in prompts], sampling))
        out = []
        for p in prompts:
            answered = VOCAB["tool"] in p
            text = "#### 5" if answered else "call add"
            tokens = [*ids(text), VOCAB["<eos>"]]
            lp = [-0.25, -0.5, -0.125] if answered else [-1.0, -2.0, -0.5]
            out.append(Generation(tokens, lp, [self.step] * 3, "stop", text))
        self.step += 1
        return out


TASKS = [
    {"question": "what is 2 + 3 ?", "answer": "#### 5"},
    {"question": "what is 3 + 2 ?", "answer": "#### 7"},
]
PROMPT = ids("<s> user : what is 2 + 3 ? <eos> <s> assistant :")


def make_loop(tokenizer, **options) -> tuple[VerlAgentLoop, ScriptedEngine]:
    engine = ScriptedEngine()
    options.setdefault("loop_class", LOOP_PATH)
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=16), task_name="verl")
    loop = VerlAgentLoop(ctx, **options)
    return loop, engine


# --- the adapter ----------------------------------------------------------------------


def test_two_turn_tool_trajectory_is_canonical(tokenizer) -> None:
    loop, _ = make_loop(tokenizer)
    [group] = loop.generate_groups(TASKS[:1], 2, ["g0"])

    assert [s.rollout_id for s in group] == ["g0/0", "g0/1"]
    assert errors(check_group(group)) == []
    s = group[0]
    assert errors(check_sample(s)) == []
    assert s.status == Status.COMPLETED
    # P = 13; response = "call add <eos>" + tool tokens (8) + "#### 5 <eos>": R = 14
    gen1, gen2 = ids("call add <eos>"), ids("#### 5 <eos>")
    assert s.prompt_ids.tolist() == PROMPT
    assert s.response_ids.tolist() == gen1 + TOOL_TOKENS + gen2
    assert s.input_ids.tolist() == PROMPT + gen1 + TOOL_TOKENS + gen2
    assert s.labels.tolist() == [IGNORE_INDEX] * 13 + gen1 + [IGNORE_INDEX] * 8 + gen2
    assert s.logprobs.tolist() == [0.0] * 13 + [-1.0, -2.0, -0.5] + [0.0] * 8 + [
        -0.25,
        -0.5,
        -0.125,
    ]
    # turn 1 at step 3, its tool answer too; turn 2 after the engine moved to step 4
    assert s.response_model_steps.tolist() == [3] * 3 + [3] * 8 + [4] * 3
    assert s.reward == {"score": 1.0, "source": "loop"}
    assert s.extra == {
        "ground_truth": "5",
        "turn_scores": [],
        "tool_rewards": [0.5],
        "steps": 2,
        "num_turns": 4,
    }
    assert (s.finish_reason, s.task_name, s.agent_loop) == ("stop", "verl", "verl")
    assert s.messages == [{"role": "user", "content": "what is 2 + 3 ?"}]


def test_concurrent_trajectories_share_one_engine_call_per_turn(tokenizer) -> None:
    loop, engine = make_loop(tokenizer)
    groups = loop.generate_groups(TASKS, 3, ["g0", "g1"])
    assert [len(g) for g in groups] == [3, 3]
    assert [len(prompts) for prompts, _ in engine.calls] == [6, 6]  # 2 tasks x 3, two turns
    first_turn_prompts, sampling = engine.calls[0]
    assert first_turn_prompts[:3] == [PROMPT] * 3
    # verl's default budget: min(response_length, prompt_length + response_length - P)
    assert sampling.max_new_tokens == 16
    assert (sampling.temperature, sampling.top_k) == (1.0, 0)
    assert loop.pop_metrics() == {
        "reward/errors": 0.0,
        "verl/failed": 0.0,
        "verl/engine_calls": 2.0,
        "verl/turns_mean": 4.0,
    }
    assert loop.pop_metrics()["verl/engine_calls"] == 0.0  # reset


def test_a_raising_loop_fails_only_its_own_samples(tokenizer) -> None:
    loop, engine = make_loop(tokenizer)
    tasks = [TASKS[0], {"question": "boom", "answer": "#### 5"}]
    good, bad = loop.generate_groups(tasks, 2, ["g0", "g1"])
    assert all(s.status == Status.COMPLETED for s in good)
    assert all(s.status == Status.FAILED for s in bad)
    assert bad[0].error == "verl: ToolCallLoop.run raised RuntimeError: tool server unreachable"
    assert [len(p) for p, _ in engine.calls] == [2, 2]  # the failed ones left the batch
    assert loop.pop_metrics()["verl/failed"] == 2.0


def test_output_that_does_not_fit_fails_with_the_field_named(tokenizer) -> None:
    loop, _ = make_loop(tokenizer)
    [[s]] = loop.generate_groups([{"question": "bad", "answer": "#### 5"}], 1, ["g0"])
    assert s.status == Status.FAILED
    assert s.error == "verl: bad loop output (response_mask has 13 entries for 14 response tokens)"


def test_response_cut_at_response_length(tokenizer) -> None:
    loop, engine = make_loop(tokenizer, response_length=5)
    [[s]] = loop.generate_groups(TASKS[:1], 1, ["g0"])
    assert errors(check_sample(s)) == []
    assert s.response_ids.tolist() == ids("call add <eos> <s> tool")
    assert s.labels[-5:].tolist() == ids("call add <eos>") + [IGNORE_INDEX] * 2
    assert s.finish_reason == "length"
    assert engine.calls[0][1].max_new_tokens == 5


def test_judger_scores_the_last_model_turn(tokenizer) -> None:
    loop, _ = make_loop(tokenizer, reward="gsm8k", loop_kwargs={"score": None})
    right, wrong = loop.generate_groups(TASKS, 1, ["g0", "g1"])
    assert right[0].reward == {
        "score": 1.0,
        "source": "gsm8k",
        "status": "ok",
        "extracted": "5",
        "correct": True,
    }
    assert wrong[0].score == 0.0  # "#### 5" against 7; the tool's "5" is not the answer


def test_no_reward_at_all_fails_with_a_clear_reason(tokenizer) -> None:
    loop, _ = make_loop(tokenizer, loop_kwargs={"score": None})
    [[s]] = loop.generate_groups(TASKS[:1], 1, ["g0"])
    assert s.status == Status.FAILED
    assert s.error.startswith("reward: the verl loop set no reward_score")
    assert loop.pop_metrics()["reward/errors"] == 1.0


def test_evaluate(tokenizer) -> None:
    loop, engine = make_loop(tokenizer, reward="gsm8k", loop_kwargs={"score": None})
    loop.generate_groups(TASKS[:1], 1, ["g0"])  # training counters survive an evaluation
    metrics = loop.evaluate(TASKS, SamplingConfig(temperature=0.0, max_new_tokens=16))
    assert metrics == {
        "eval/accuracy": 0.5,
        "eval/accuracy_ci_low": 0.0,
        "eval/accuracy_ci_high": 1.0,
        "eval/response_len/mean": 14.0,
        "eval/truncated_frac": 0.0,
        "eval/failed": 0.0,
        "eval/reward_errors": 0.0,
        "eval/n": 2.0,
    }
    assert engine.calls[-1][1].temperature == 0.0
    assert loop.pop_metrics()["verl/engine_calls"] == 2.0  # the training call only


def test_evaluate_counts_failures_by_reason_and_fails_when_all_fail(tokenizer) -> None:
    loop, _ = make_loop(tokenizer)
    boom = {"question": "boom", "answer": "#### 5"}
    metrics = loop.evaluate([TASKS[0], boom], SamplingConfig(temperature=0.0, max_new_tokens=16))
    assert metrics["eval/failed"] == 1.0
    assert metrics["eval/failures/verl: ToolCallLoop.run raised RuntimeError"] == 1.0
    with pytest.raises(
        EvaluationFailed,
        match=r"all 2 samples failed: verl: ToolCallLoop\.run "
        r"raised RuntimeError \(2\)$",
    ):
        loop.evaluate([boom, boom], SamplingConfig(temperature=0.0, max_new_tokens=16))


def test_built_from_its_options_by_name(tokenizer) -> None:
    ctx = LoopContext(ScriptedEngine(), tokenizer, SamplingConfig(), task_name="calc")
    options = {"loop_class": LOOP_PATH, "prompt_length": 64}
    loop = AGENT_LOOPS.get("verl").from_config(options, ctx)
    assert isinstance(loop, VerlAgentLoop)
    assert (loop.loop_cls.__name__, loop.prompt_length) == ("ToolCallLoop", 64)
    assert loop.task_name == "calc"
    with pytest.raises(ValueError, match=r"^agent_loop\.options\.turns: agent loop 'verl' has no"):
        AGENT_LOOPS.get("verl").from_config({"loop_class": LOOP_PATH, "turns": 3}, ctx)
    with pytest.raises(ValueError, match=r"^agent_loop\.options\.loop_class is required by agent"):
        AGENT_LOOPS.get("verl").from_config({}, ctx)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("ToolCallLoop", "is not an import path"),
        ("no_such_module.Loop", "cannot import 'no_such_module'"),
        (f"{__name__}.Missing", "has no class 'Missing'"),
        (f"{__name__}.Output", "has no `async def run"),
        ("verl.experimental.agent_loop.ToolAgentLoop", "scripts/verl_env.sh"),
    ],
)
def test_bad_loop_class(tokenizer, path: str, message: str) -> None:
    try:
        import verl  # noqa: F401

        if path.startswith("verl."):
            pytest.skip("verl is installed here")
    except ImportError:
        pass
    with pytest.raises(ValueError, match=message):
        make_loop(tokenizer, loop_class=path)


def test_unknown_judger(tokenizer) -> None:
    with pytest.raises(ValueError, match="'exact' is not a judger; known: gsm8k"):
        make_loop(tokenizer, reward="exact")


# --- the pieces -----------------------------------------------------------------------


def test_canonical_fields_worked_example() -> None:
    # data-contract section 7: P = 3, R = 3, token 21 is environment output
    f = canonical_fields(
        [10, 11, 12], [20, 21, 22], [1, 0, 1], [-0.1, 0.0, -0.3], [5, 6], default_step=9
    )
    assert f.input_ids.tolist() == [10, 11, 12, 20, 21, 22]
    assert f.labels.tolist() == [-100, -100, -100, 20, -100, 22]
    assert f.logprobs.tolist() == [0.0, 0.0, 0.0, -0.1, 0.0, -0.3]
    assert f.response_model_steps.tolist() == [5, 5, 6]


def test_canonical_fields_steps_and_refusals() -> None:
    # leading glue takes the first turn's step; an all-env response takes the default
    f = canonical_fields([1, 2], [7, 8, 9, 7], [0, 1, 0, 1], None, [4, 6, 6], default_step=9)
    assert (f.response_model_steps.tolist(), f.logprobs) == ([4, 4, 4, 6], None)
    assert canonical_fields([1, 2], [7], [0], None, [], 9).response_model_steps.tolist() == [9]
    with pytest.raises(
        ValueError, match="marks 2 tokens as generated but the engine generated only 1"
    ):
        canonical_fields([1], [7, 8], [1, 1], None, [4], 9)
    with pytest.raises(ValueError, match=r"response_mask holds \[2\]"):
        canonical_fields([1], [7, 8], [1, 2], None, [4, 4], 9)
    with pytest.raises(ValueError, match="response_logprobs has 1 entries for 2"):
        canonical_fields([1], [7, 8], [1, 1], [-1.0], [4, 4], 9)
    with pytest.raises(ValueError, match="go back in time"):
        canonical_fields([1], [7, 8], [1, 1], None, [5, 4], 9)


def test_last_turn() -> None:
    assert last_turn([1, 1, 0, 0, 1, 1, 1, 0]) == slice(4, 7)
    assert last_turn([0, 1, 1]) == slice(1, 3)
    assert last_turn([0, 0]) == slice(0, 0)


def test_to_sampling(tokenizer) -> None:
    text = {VOCAB["?"]: "?", VOCAB["####"]: "####"}.__getitem__
    s = to_sampling(
        {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0,
         "logprobs": True, "stop_token_ids": [VOCAB["####"]], "stop": "?"},
        budget=12,
        token_text=text,
    )  # fmt: skip
    assert s == SamplingConfig(
        temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12, stop=["####", "?"]
    )
    assert to_sampling({"max_tokens": 3, "top_k": 20}, 12, text).max_new_tokens == 3
    assert to_sampling({}, 0, text).max_new_tokens == 1  # no room left: still one token
    with pytest.raises(ValueError, match=r"sampling_params\['repetition_penalty'\] = 1.1"):
        to_sampling({"repetition_penalty": 1.1}, 12, text)
    with pytest.raises(ValueError, match=r"sampling_params \['min_tokens'\] are not supported"):
        to_sampling({"min_tokens": 2}, 12, text)
    params = sampling_params_of(SamplingConfig(temperature=0.5, top_k=0, stop=["?"]))
    assert to_sampling(params, 8, text) == SamplingConfig(
        temperature=0.5, max_new_tokens=8, stop=["?"]
    )


def test_trainer_config_has_what_verl_loops_read() -> None:
    config = trainer_config(
        prompt_length=64,
        response_length=32,
        sampling=SamplingConfig(temperature=0.5, top_k=0),
        multi_turn={"max_assistant_turns": 2},
        overrides={"actor_rollout_ref": {"rollout": {"full_determinism": True}}},
    )
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.prompt_length, rollout.response_length, rollout.top_k) == (64, 32, -1)
    assert rollout.full_determinism is True
    assert rollout.multi_turn.max_assistant_turns == 2
    assert rollout.multi_turn.max_tool_response_length == 256  # verl's default kept
    assert rollout.multi_turn.format == "hermes"
    assert config.data.get("apply_chat_template_kwargs", {}) == {}
    with pytest.raises(ValueError, match=r"response_length \(0\) must be >= 1"):
        trainer_config(prompt_length=8, response_length=0, sampling=SamplingConfig())


def test_tool_config_paths(tokenizer) -> None:
    shipped = resolve_tool_path("builtin:calculator_tool.yaml")
    assert shipped is not None and shipped.endswith("rltool/verl_compat/calculator_tool.yaml")
    assert resolve_tool_path("tools/mine.yaml") == "tools/mine.yaml"
    with pytest.raises(ValueError, match=r"known: builtin:calculator_tool\.yaml"):
        resolve_tool_path("builtin:nope.yaml")
    try:
        import verl  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="need verl installed"):
            make_loop(tokenizer, multi_turn={"tool_config_path": "builtin:calculator_tool.yaml"})


class NoOutputLoop(ToolCallLoop):
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> Any:
        return {"prompt_ids": [1, 2]}  # not an AgentLoopOutput


def test_a_loop_returning_no_agent_loop_output_fails(tokenizer) -> None:
    loop, _ = make_loop(tokenizer, loop_class=f"{__name__}.NoOutputLoop")
    [[s]] = loop.generate_groups(TASKS[:1], 1, ["g0"])
    assert s.status == Status.FAILED
    assert s.error == "verl: bad loop output ('dict' object has no attribute 'response_mask')"


def test_a_mapped_rows_messages_come_first(tokenizer) -> None:
    loop, _ = make_loop(tokenizer)
    row = {
        "messages": [{"role": "user", "content": "a"}],
        "prompt": [{"role": "user", "content": "b"}],
    }
    assert loop.raw_prompt(row) == [{"role": "user", "content": "a"}]
    assert loop.raw_prompt({"prompt": [{"role": "user", "content": "b"}]})[0]["content"] == "b"
