"""GSM8KLoop: chat prompts, one batched generate call, canonical rewarded states."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rltool.agent_loops.base import AGENT_LOOPS, LoopContext
from rltool.agent_loops.evaluation import EvaluationFailed
from rltool.agent_loops.gsm8k import GSM8KLoop
from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation, RolloutEngine
from rltool.rewards.gsm8k import RewardResult
from rltool.rollout.contract import check_group, errors
from rltool.rollout.state import IGNORE_INDEX, Status

WORDS = ["<pad>", "<eos>", "<s>", "user", "system", "assistant", ":", "what", "is", "2", "+",
         "3", "?", "####", "5", "6", "be", "brief", "7", "*", "49"]  # fmt: skip
VOCAB = {w: i for i, w in enumerate(WORDS)}
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", chat_template=TEMPLATE
    )


def ids(text: str) -> list[int]:
    return [VOCAB[w] for w in text.split()]


class FakeEngine(RolloutEngine):
    """Returns scripted responses in order; records every generate call."""

    def __init__(self, responses: list[tuple[str, str]]):
        self.responses = responses  # (text, finish_reason)
        self.calls: list[tuple[list[list[int]], SamplingConfig]] = []

    @property
    def model_step(self) -> int:
        return 3

    def sync_weights(self, model_step: int) -> None:
        raise AssertionError("not used")

    def load_weights(self, state_dict, model_step: int) -> None:
        raise AssertionError("not used")

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        self.calls.append(([list(p) for p in prompts], sampling))
        out = []
        for i in range(len(prompts)):
            text, finish = self.responses[i % len(self.responses)]
            tokens = ids(text) + ([VOCAB["<eos>"]] if finish == "stop" else [])
            out.append(
                Generation(
                    token_ids=tokens,
                    logprobs=[-0.5] * len(tokens),
                    model_steps=[3] * len(tokens),
                    finish_reason=finish,
                    text=text,
                )
            )
        return out


TASKS = [
    {"question": "what is 2 + 3 ?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "what is 7 * 7 ?", "answer": "7 * 7 = 49\n#### 49"},
]
PROMPT0 = ids("<s> user : what is 2 + 3 ? <eos> <s> assistant :")
PROMPT1 = ids("<s> user : what is 7 * 7 ? <eos> <s> assistant :")


def make_loop(tokenizer, responses, **kwargs) -> tuple[GSM8KLoop, FakeEngine]:
    engine = FakeEngine(responses)
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=8), task_name="gsm8k")
    return GSM8KLoop(ctx, **kwargs), engine


def test_groups_are_batched_canonical_and_rewarded(tokenizer) -> None:
    responses = [("#### 5", "stop"), ("#### 6", "stop"), ("#### 49", "stop"), ("2 +", "length")]
    loop, engine = make_loop(tokenizer, responses)
    groups = loop.generate_groups(TASKS, 2, ["g0", "g1"])

    assert len(engine.calls) == 1  # all prompts x n in ONE generate call
    prompts, sampling = engine.calls[0]
    assert prompts == [PROMPT0, PROMPT0, PROMPT1, PROMPT1]
    assert sampling.max_new_tokens == 8

    assert [[s.rollout_id for s in g] for g in groups] == [["g0/0", "g0/1"], ["g1/0", "g1/1"]]
    assert [[s.score for s in g] for g in groups] == [[1.0, 0.0], [1.0, 0.0]]
    for group in groups:
        assert errors(check_group(group)) == []
        assert all(s.status == Status.COMPLETED for s in group)

    s = groups[0][0]  # prompt P = 13 tokens, response "#### 5 <eos>" R = 3
    response = ids("#### 5 <eos>")
    assert s.prompt_ids.tolist() == PROMPT0
    assert s.input_ids.tolist() == PROMPT0 + response
    assert s.labels.tolist() == [IGNORE_INDEX] * 13 + response
    assert s.logprobs.tolist() == [0.0] * 13 + [-0.5] * 3
    assert s.response_model_steps.tolist() == [3, 3, 3]
    assert s.reward == {"score": 1.0, "status": "ok", "extracted": "5", "correct": True}
    assert s.extra == {"ground_truth": "5"}
    assert (s.task_name, s.agent_loop, s.group_id, s.finish_reason) == (
        "gsm8k",
        "gsm8k",
        "g0",
        "stop",
    )
    assert s.messages[-1] == {"role": "assistant", "content": "#### 5"}

    truncated = groups[1][1]
    assert truncated.finish_reason == "length"
    assert truncated.reward["extracted"] == "2"  # the last number of "2 +"
    assert truncated.score == 0.0


def test_generate_group_and_system_prompt(tokenizer) -> None:
    loop, engine = make_loop(tokenizer, [("#### 5", "stop")], system_prompt="be brief")
    group = loop.generate_group(TASKS[0], 3, "g7")
    assert [s.rollout_id for s in group] == ["g7/0", "g7/1", "g7/2"]
    assert engine.calls[0][0][0] == ids("<s> system : be brief <eos>") + PROMPT0
    assert group[0].messages[0] == {"role": "system", "content": "be brief"}


def test_reward_error_fails_the_sample_and_is_counted(tokenizer, monkeypatch) -> None:
    import rltool.agent_loops.gsm8k as loop_mod

    def reward(text: str, truth: str) -> RewardResult:
        if text == "#### 6":
            return RewardResult(None, "error", "math-verify timed out", extracted="6")
        return RewardResult(1.0, "ok", extracted="5")

    monkeypatch.setattr(loop_mod, "gsm8k_reward", reward)
    loop, _ = make_loop(tokenizer, [("#### 5", "stop"), ("#### 6", "stop")])
    (group,) = loop.generate_groups(TASKS[:1], 2, ["g0"])
    ok, bad = group
    assert ok.status == Status.COMPLETED
    assert bad.status == Status.FAILED
    assert bad.error == "reward: math-verify timed out"
    assert bad.score is None  # never a silent 0.0
    assert bad.reward["status"] == "error"
    assert loop.pop_metrics() == {"reward/errors": 1.0}
    assert loop.pop_metrics() == {"reward/errors": 0.0}  # reset after reading


def test_engine_output_that_breaks_the_contract_fails_the_sample(tokenizer) -> None:
    class ShortLogprobs(FakeEngine):
        def generate(self, prompts, sampling):
            gens = super().generate(prompts, sampling)
            gens[0].logprobs = gens[0].logprobs[:-1]
            return gens

    engine = ShortLogprobs([("#### 5", "stop")])
    loop = GSM8KLoop(LoopContext(engine, tokenizer, SamplingConfig(), task_name="gsm8k"))
    first, second = loop.generate_group(TASKS[0], 2, "g0")
    assert first.status == Status.FAILED
    assert "2 response logprobs for 3 response tokens" in first.error
    assert second.status == Status.COMPLETED


def test_evaluate_accuracy_length_and_truncation(tokenizer) -> None:
    responses = [("#### 5", "stop"), ("#### 7", "length")]
    loop, engine = make_loop(tokenizer, responses)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4)
    metrics = loop.evaluate(TASKS, greedy)
    assert engine.calls[0][0] == [PROMPT0, PROMPT1]
    assert engine.calls[0][1] is greedy
    # task 0 right (3 tokens with <eos>), task 1 wrong and cut (2 tokens)
    # rows [1, 0]: a resample of both rows is all 1 (or all 0) with chance 1/4: interval [0, 1]
    assert metrics == {
        "eval/accuracy": 0.5,
        "eval/accuracy_ci_low": 0.0,
        "eval/accuracy_ci_high": 1.0,
        "eval/response_len/mean": 2.5,
        "eval/truncated_frac": 0.5,
        "eval/reward_errors": 0.0,
        "eval/failed": 0.0,
        "eval/n": 2.0,
    }


def test_evaluate_counts_failed_samples_by_reason_and_fails_when_all_fail(
    tokenizer, monkeypatch
) -> None:
    import rltool.agent_loops.gsm8k as loop_mod

    def reward(text: str, truth: str) -> RewardResult:
        if text == "#### 5":
            return RewardResult(1.0, "ok", extracted="5")
        return RewardResult(None, "error", f"timeout (on {text!r})", extracted=None)

    monkeypatch.setattr(loop_mod, "gsm8k_reward", reward)
    loop, _ = make_loop(tokenizer, [("#### 5", "stop"), ("#### 7", "stop")])
    loop._reward_errors = 4  # a training count: evaluation leaves it alone
    metrics = loop.evaluate(TASKS, SamplingConfig(temperature=0.0))
    assert metrics["eval/accuracy"] == 0.5
    assert metrics["eval/failed"] == 1.0
    assert metrics["eval/failures/reward: timeout"] == 1.0
    assert metrics["eval/reward_errors"] == 1.0
    assert loop.pop_metrics() == {"reward/errors": 4.0}

    loop, _ = make_loop(tokenizer, [("#### 7", "stop")])
    with pytest.raises(EvaluationFailed) as info:
        loop.evaluate(TASKS, SamplingConfig(temperature=0.0))
    assert str(info.value) == (
        "evaluation of task 'gsm8k': all 2 samples failed: reward: timeout (2)"
    )


def test_task_without_question_is_a_clear_error(tokenizer) -> None:
    loop, _ = make_loop(tokenizer, [("#### 5", "stop")])
    with pytest.raises(ValueError, match="no 'question' or 'messages' field"):
        loop.generate_group({"prompt": "hi", "answer": "1"}, 1, "g0")


def test_a_row_with_messages_is_rendered_with_the_chat_template(tokenizer) -> None:
    # a prompt mapped from chat messages (verl's layout) is used as given, not as a question
    row = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is 2 + 3 ?"},
        ],
        "question": "what is 7 * 7 ?",
        "answer": "5",
    }
    loop, engine = make_loop(tokenizer, [("#### 5", "stop")], system_prompt="what")
    [state] = loop.generate_group(row, 1, "g0")
    # the row's own system message is kept; system_prompt is not added a second time
    assert engine.calls[0][0][0] == ids(
        "<s> system : be brief <eos> <s> user : what is 2 + 3 ? <eos> <s> assistant :"
    )
    assert state.messages[:2] == row["messages"]
    assert state.reward["correct"] is True


def test_system_prompt_goes_before_messages_without_one(tokenizer) -> None:
    row = {"messages": [{"role": "user", "content": "what is 2 + 3 ?"}], "answer": "5"}
    loop, engine = make_loop(tokenizer, [("#### 6", "stop")], system_prompt="be brief")
    [state] = loop.generate_group(row, 1, "g0")
    assert engine.calls[0][0][0] == ids(
        "<s> system : be brief <eos> <s> user : what is 2 + 3 ? <eos> <s> assistant :"
    )
    assert state.reward["correct"] is False


def test_registry_builds_gsm8k_and_lists_known_loops() -> None:
    assert AGENT_LOOPS.get("gsm8k") is GSM8KLoop
    assert "gsm8k" in AGENT_LOOPS.names()
    with pytest.raises(ValueError, match=r"^agent_loop\.name: unknown agent loop 'gsm9k'; known: "):
        AGENT_LOOPS.get("gsm9k")
