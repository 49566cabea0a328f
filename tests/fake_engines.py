"""A rollout engine that answers from a fixed list of texts: a fast stand-in for tests that
exercise what surrounds generation."""

from __future__ import annotations

from collections.abc import Sequence

from rltool.engines.base import Generation, RolloutEngine


class FixedReplyEngine(RolloutEngine):
    """Answers the i-th prompt of a call with ``texts[i % len(texts)]`` + EOS (logprob -0.5 a
    token, model step 0); one text answers every prompt alike. Counts calls and prompts."""

    def __init__(self, tokenizer, texts: str | Sequence[str] = "ok") -> None:
        self.texts = [texts] if isinstance(texts, str) else list(texts)
        eos = tokenizer.eos_token_id
        self.ids = [[*tokenizer.encode(t, add_special_tokens=False), eos] for t in self.texts]
        self.calls = 0  # generate calls
        self.prompts = 0  # prompts answered

    @property
    def model_step(self) -> int:
        return 0

    def sync_weights(self, model_step: int) -> None:
        pass

    def load_weights(self, state_dict, model_step: int) -> None:
        pass

    def generate(self, prompts, sampling):
        self.calls += 1
        self.prompts += len(prompts)
        out = []
        for i in range(len(prompts)):
            k = i % len(self.ids)
            n = len(self.ids[k])
            out.append(Generation(list(self.ids[k]), [-0.5] * n, [0] * n, "stop", self.texts[k]))
        return out
