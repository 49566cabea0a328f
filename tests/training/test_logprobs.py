"""Packed-row logprobs: packing must be exact, and the test must be able to fail."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import random_qwen2

from rltool.training.attention import NATIVE, SDPA_VARLEN, choose_kernels
from rltool.training.batch import Pack
from rltool.training.logprobs import entropy_from_logits, forward_logprobs, token_logprobs

VOCAB = 101


def tiny_qwen2(attn: str) -> torch.nn.Module:
    return random_qwen2(VOCAB, attn=attn).eval()


def pack_of(samples: list[tuple[list[int], list[int]]], attention: str = SDPA_VARLEN) -> Pack:
    """A row from (model input, targets) pairs, already shifted."""
    ids = [t for s, _ in samples for t in s]
    targets = [t for _, tg in samples for t in tg]
    lens = [len(s) for s, _ in samples]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return Pack(
        input_ids=torch.tensor(ids),
        targets=torch.tensor(targets),
        advantages=torch.zeros(len(ids)),
        rollout_logprobs=torch.zeros(len(ids)),
        has_rollout_logprobs=torch.ones(len(ids), dtype=torch.bool),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        cu_seq_lens=torch.tensor(cu, dtype=torch.int32),
        max_seq_len=max(lens),
        sample_index=list(range(len(samples))),
        attention=attention,
    )


def three_samples() -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n, prompt in ((7, 3), (5, 2), (9, 4)):
        seq = torch.randint(1, VOCAB, (n + 1,), generator=g).tolist()
        targets = [-100] * (prompt - 1) + seq[prompt:]  # labels[1:], prompt unsupervised
        out.append((seq[:-1], targets))
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_row_equals_each_sample_alone(attn: str, temperature: float) -> None:
    model = tiny_qwen2(attn)
    samples = three_samples()
    kernel = choose_kernels(attn, "cpu")[0]  # as conversion lays the rows out
    with torch.no_grad():
        packed, ent_packed = forward_logprobs(model, pack_of(samples, kernel), temperature, True)
        alone = [forward_logprobs(model, pack_of([s]), temperature, True) for s in samples]
    assert torch.cat([a[0] for a in alone]).sub(packed).abs().max() < 1e-5
    assert torch.cat([a[1] for a in alone]).sub(ent_packed).abs().max() < 1e-5
    targets = pack_of(samples).targets
    assert (packed[targets == -100] == 0).all()
    assert (packed[targets != -100] < 0).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_wrong_position_ids_leak_across_samples(attn: str) -> None:
    """Negative control: with transformers' own mask (``native``: eager rows, the reference
    of the kernels), positions that do not restart let sample 2 see sample 1."""
    model = tiny_qwen2(attn)
    samples = three_samples()
    pack = pack_of(samples, NATIVE)
    with torch.no_grad():
        right, _ = forward_logprobs(model, pack, 1.0, False)
        pack.position_ids = torch.arange(len(pack))
        wrong, _ = forward_logprobs(model, pack, 1.0, False)
    first = int(pack.cu_seq_lens[1])
    # causal: sample 1 is unaffected, up to the last bits of another mask
    torch.testing.assert_close(right[:first], wrong[:first], atol=1e-5, rtol=0)
    assert (right[first:] - wrong[first:]).abs().max() > 1e-3  # 100x that tolerance


def test_use_cache_true_leaks_across_samples() -> None:
    """Negative control for the flag itself: with the cache on, the mask is not derived."""
    model = tiny_qwen2("sdpa")
    samples = three_samples()
    pack = pack_of(samples)
    with torch.no_grad():
        right, _ = forward_logprobs(model, pack, 1.0, False)
        out = model(
            input_ids=pack.input_ids[None],
            position_ids=pack.position_ids[None],
            attention_mask=None,
            use_cache=True,
        )
        leaky, _ = token_logprobs(out.logits[0], pack.targets, 1.0)
    first = int(pack.cu_seq_lens[1])
    assert (right[first:] - leaky[first:]).abs().max() > 1e-3


def test_token_logprobs_hand_worked() -> None:
    # row 0: logits [0, ln 3] -> p = [1/4, 3/4]; row 1 ignored; temperature 2 on row 2
    logits = torch.tensor([[0.0, math.log(3.0)], [5.0, 1.0], [0.0, 2 * math.log(3.0)]])
    logp, _ = token_logprobs(logits, torch.tensor([1, -100, 0]), 2.0)
    # temperature 2: row 0 -> [0, ln 3 / 2] -> p1 = sqrt3 / (1 + sqrt3); row 2 -> p0 = 1/4
    expected = [math.log(math.sqrt(3) / (1 + math.sqrt(3))), 0.0, math.log(0.25)]
    assert logp.tolist() == pytest.approx(expected, abs=1e-6)


def test_entropy_hand_worked() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]])
    p = torch.tensor([0.25, 0.75])
    expected = [math.log(4.0), float(-(p * p.log()).sum())]
    assert entropy_from_logits(logits).tolist() == pytest.approx(expected, abs=1e-6)


def test_logprob_gradient_flows_to_the_model() -> None:
    model = tiny_qwen2("sdpa")
    logp, entropy = forward_logprobs(model, pack_of(three_samples()), 1.0, True)
    (logp.sum() + entropy.sum()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
