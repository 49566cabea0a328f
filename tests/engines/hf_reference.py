"""The reference the HF engine tests check logprobs and greedy tokens against: one plain
forward."""

from __future__ import annotations

import torch
from token_margins import stable_length, top_gaps


def reference_logprobs(model, prompt_ids, token_ids, temperature):
    """log_softmax(logits / T) at the chosen tokens, from one unpadded forward, no cache."""
    ids = torch.tensor([prompt_ids + token_ids])  # [1, P+R]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0]  # [P+R, V]
    step_logits = logits[len(prompt_ids) - 1 : -1] / temperature  # [R, V]
    lp = torch.log_softmax(step_logits, -1)  # [R, V]
    return lp.gather(-1, torch.tensor(token_ids)[:, None])[:, 0], step_logits.argmax(-1)  # [R], [R]


def assert_clear_greedy(model, prompts: list[list[int]], gens) -> None:
    """Every greedy token of ``gens`` (one Generation per prompt) won by a margin that no
    kernel, batch shape or CPU can close: then another path's greedy tokens must be the same
    ones, and a test may compare them exactly. A fixture that fails this has a near-tie
    (any answer is right there): pick another prompt or seed."""
    for i, (prompt_ids, gen) in enumerate(zip(prompts, gens, strict=True)):
        ids = torch.tensor([prompt_ids + gen.token_ids])  # [1, P+R]
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0]  # [P+R, V]
        gaps = top_gaps(logits[len(prompt_ids) - 1 : -1])  # [R]
        n = stable_length(gaps)
        assert n == len(gaps), f"prompt {i}: near-tie at step {n} (gap {float(gaps[n]):.1e})"
