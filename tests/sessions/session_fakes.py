"""Shared helpers of the session-server tests: an engine scripted to say given texts,
a tool, and chat-template rendering."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation, RolloutEngine

GEN_PROMPT = "<|im_start|>assistant\n"
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER_TEXT = "2 + 3 = 5"


def render_text(tok, messages: list[dict[str, Any]], gen: bool, tools=None) -> str:
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)


def render_ids(tok, messages: list[dict[str, Any]], gen: bool, tools=None) -> list[int]:
    return tok.encode(render_text(tok, messages, gen, tools), add_special_tokens=False)


def logprobs_for(n: int, turn: int) -> list[float]:
    """Distinct, hand-checkable logprobs: turn t, token i -> -(t + 1) / 10 - i / 1000."""
    return [-(turn + 1) / 10 - i / 1000 for i in range(n)]


class ScriptedEngine(RolloutEngine):
    """Says its scripted replies in order, each ending with EOS, at a settable model step.

    A reply is a text (encoded canonically) or a list of token ids (to emit a
    non-canonical tokenization). Records every call's prompts and sampling.
    """

    def __init__(self, tokenizer, replies: Sequence[str | list[int]], model_step: int = 0):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self._step = model_step
        self.calls: list[tuple[list[list[int]], SamplingConfig]] = []
        self.generated = 0  # replies said so far; turn t gets logprobs_for(n, t)

    @property
    def model_step(self) -> int:
        return self._step

    def sync_weights(self, model_step: int) -> None:
        self._step = model_step

    def load_weights(self, state_dict, model_step: int) -> None:
        self._step = model_step

    def generate(self, prompts, sampling):
        self.calls.append(([list(p) for p in prompts], sampling))
        out = []
        for _ in prompts:
            reply = self.replies.pop(0)
            ids = (
                reply
                if isinstance(reply, list)
                else self.tokenizer.encode(reply, add_special_tokens=False)
            )
            ids = [*ids, self.tokenizer.eos_token_id]
            out.append(
                Generation(
                    token_ids=ids,
                    logprobs=logprobs_for(len(ids), self.generated),
                    model_steps=[self._step] * len(ids),
                    finish_reason="stop",
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                )
            )
            self.generated += 1
        return out
