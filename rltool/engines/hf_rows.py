"""What each row of an HF engine ``generate`` made so far: a row stopped at a pause point for
new weights goes on later from its prompt plus these tokens, so its tokens, logprobs and the
weight version of each token are kept apart from any one decode call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rltool.engines.base import Generation


@dataclass(slots=True)
class RowsSoFar:
    """Per row (lists of R entries): tokens, logprobs and model steps so far, finished."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    steps: list[list[int]]
    finished: list[bool]
    routing: list[Any]  # [C + R, L, k] per row, from its latest call (None: not recorded)

    @classmethod
    def empty(cls, rows: int) -> RowsSoFar:
        return cls(
            [[] for _ in range(rows)],
            [[] for _ in range(rows)],
            [[] for _ in range(rows)],
            [False] * rows,
            [None] * rows,
        )

    def add(
        self, r: int, tokens: list[int], logprobs: list[float], model_step: int, finished: bool
    ) -> None:
        """Row ``r`` made ``tokens`` (their ``logprobs``) with the weights of ``model_step``."""
        self.tokens[r] += tokens
        self.logprobs[r] += logprobs
        self.steps[r] += [model_step] * len(tokens)
        self.finished[r] = finished

    def unfinished(self, rows: range | list[int], max_new: int) -> list[int]:
        """Those of ``rows`` that go on: no EOS or stop string yet, fewer than ``max_new``."""
        return [r for r in rows if not self.finished[r] and len(self.tokens[r]) < max_new]

    def generations(self, tokenizer: Any) -> list[Generation]:
        return [
            Generation(
                token_ids=self.tokens[r],
                logprobs=self.logprobs[r],
                model_steps=self.steps[r],
                finish_reason="stop" if self.finished[r] else "length",
                text=tokenizer.decode(self.tokens[r], skip_special_tokens=True),
                routed_experts=self.routing[r],
            )
            for r in range(len(self.tokens))
        ]
