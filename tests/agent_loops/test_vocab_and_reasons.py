"""The gsm8k loop at generation: a token id outside the policy's vocabulary fails its sample
(never COMPLETED, never dumped as valid), and NaN logprobs over three steps give one failure
reason with a count and one print of the whole error (issue 21, items 3 and 8)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from rich.console import Console
from test_gsm8k import TASKS, TEMPLATE, VOCAB, ids
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rltool.agent_loops.base import LoopContext
from rltool.agent_loops.gsm8k import GSM8KLoop
from rltool.app.failed_steps import new_failures
from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation, RolloutEngine
from rltool.produce.result import failure_metrics
from rltool.report.train_view import TrainView
from rltool.rollout.failures import failure_reason
from rltool.rollout.state import Status

V = len(VOCAB)  # 21 token ids: 0..20


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:  # test_gsm8k's
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", chat_template=TEMPLATE
    )


class ScriptedEngine(RolloutEngine):
    """Answers every prompt with ``tokens`` and ``logprobs`` (or an engine error)."""

    def __init__(self, tokens: list[int], logprobs: list[float], error: str | None = None):
        self.tokens, self.logprobs, self.error = tokens, logprobs, error
        self.vocab_size = V

    @property
    def model_step(self) -> int:
        return 0

    def sync_weights(self, model_step: int) -> None:
        raise AssertionError("not used")

    def load_weights(self, state_dict, model_step: int) -> None:
        raise AssertionError("not used")

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        n, lp = len(self.tokens), list(self.logprobs)
        return [
            Generation(list(self.tokens), lp, [0] * n, "stop", "", error=self.error)
            for _ in prompts
        ]


def loop_of(tokenizer, engine: RolloutEngine) -> GSM8KLoop:
    return GSM8KLoop(LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=8), "gsm8k"))


def test_an_id_at_the_vocab_size_fails_the_sample_with_a_named_reason(tokenizer) -> None:
    engine = ScriptedEngine([*ids("#### 5"), V], [-0.1, -0.2, -0.3])
    (group,) = loop_of(tokenizer, engine).generate_groups(TASKS[:1], 2, ["g0"])
    for s in group:
        assert s.status == Status.FAILED
        assert failure_reason(s.error) == "contract: token ids in the vocabulary"
        assert f"input_ids[15]: token id {V} outside the vocabulary [0, {V})" in s.error


def test_an_engine_error_fails_the_sample_and_keeps_no_ids(tokenizer) -> None:
    why = "openai_server: token id outside the vocabulary (token id -3 ... at position 1)"
    engine = ScriptedEngine([VOCAB["5"], -3], [-0.1, -0.2], error=why)
    (group,) = loop_of(tokenizer, engine).generate_groups(TASKS[:1], 1, ["g0"])
    (s,) = group
    assert (s.status, s.error, s.response_ids, s.input_ids) == (Status.FAILED, why, None, None)
    assert failure_reason(s.error) == "openai_server: token id outside the vocabulary"


def test_three_steps_of_nan_logprobs_give_one_reason_and_one_whole_error(tokenizer) -> None:
    tokens = [*ids("#### 5"), VOCAB["<eos>"]]
    loop = loop_of(tokenizer, ScriptedEngine(tokens, [-0.1, float("nan"), -0.3]))
    view = TrainView(console=Console(record=True, width=120))
    seen: set[str] = set()
    for step in (1, 2, 3):
        groups = loop.generate_groups(TASKS, 4, [f"s{step}g0", f"s{step}g1"])
        metrics = failure_metrics(groups)
        assert metrics == {"failures/samples": 8.0, "failures/contract: logprobs finite": 8.0}
        view.step_line(step, {**metrics, "data/training_samples": 0.0}, [])
        for reason, example in new_failures(groups, seen):
            view.failure(reason, example)
    text = view.console.export_text(styles=False)
    assert text.count("new failure reason: contract: logprobs finite") == 1
    assert text.count("logprobs[14]: not finite (nan) (invariant 4)") == 1  # the whole error
    assert text.count("failed samples: 8 (8 contract: logprobs finite)") == 3
