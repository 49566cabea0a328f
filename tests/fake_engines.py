"""A rollout engine that answers every prompt at once with the same text: a fast stand-in
for tests that exercise what surrounds generation."""

from __future__ import annotations

from rltool.engines.base import Generation, RolloutEngine


class FixedReplyEngine(RolloutEngine):
    """Answers every prompt with ``text`` + EOS (logprob -0.5 a token, model step 0);
    counts its calls and the prompts it answered."""

    def __init__(self, tokenizer, text: str = "ok") -> None:
        self.ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        self.text = text
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
        n = len(self.ids)
        return [Generation(list(self.ids), [-0.5] * n, [0] * n, "stop", self.text) for _ in prompts]
