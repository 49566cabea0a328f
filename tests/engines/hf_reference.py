"""The reference the HF engine tests check logprobs against: one plain forward."""

from __future__ import annotations

import torch


def reference_logprobs(model, prompt_ids, token_ids, temperature):
    """log_softmax(logits / T) at the chosen tokens, from one unpadded forward, no cache."""
    ids = torch.tensor([prompt_ids + token_ids])  # [1, P+R]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0]  # [P+R, V]
    step_logits = logits[len(prompt_ids) - 1 : -1] / temperature  # [R, V]
    lp = torch.log_softmax(step_logits, -1)  # [R, V]
    return lp.gather(-1, torch.tensor(token_ids)[:, None])[:, 0], step_logits.argmax(-1)  # [R], [R]
