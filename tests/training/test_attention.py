"""Attention kernels of packed rows: logits and gradients equal the dense-mask reference,
no [N, N] mask is built, and the kernel is chosen at conversion."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from tiny_models import random_qwen2
from token_margins import stable_length, top_gaps
from transformers import masking_utils

from rltool.training import attention
from rltool.training.attention import (
    DENSE,
    FLASH_VARLEN,
    FLEX_BLOCK,
    NATIVE,
    SDPA_TREE,
    SDPA_VARLEN,
    choose_kernels,
    pieces_of,
    segments_of,
    tree_mask_mod,
)
from rltool.training.batch import Pack
from rltool.training.layout.shared_prefix import share_prefixes
from rltool.training.logprobs import attention_allowed, check_attention, packed_logits

VOCAB = 101


def model_of(attn: str = "sdpa") -> torch.nn.Module:
    return random_qwen2(VOCAB, attn=attn).eval()


def grpo_rows() -> list[Pack]:
    """Two prompts x 3 responses in two plain rows (members of a group spread over rows)."""
    g = torch.Generator().manual_seed(5)
    samples = []
    for prompt_len in (6, 4):
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=g)
        for k in range(3):
            seq = torch.cat([prompt, torch.randint(1, VOCAB, (2 + 2 * k,), generator=g)])
            targets = torch.cat([torch.full((prompt_len - 1,), -100), seq[prompt_len:]])
            samples.append((seq[:-1], targets))

    def pack(idx: list[int]) -> Pack:
        lens = [len(samples[i][0]) for i in idx]
        n = sum(lens)
        return Pack(
            input_ids=torch.cat([samples[i][0] for i in idx]),
            targets=torch.cat([samples[i][1] for i in idx]),
            advantages=torch.zeros(n),
            rollout_logprobs=torch.zeros(n),
            has_rollout_logprobs=torch.ones(n, dtype=torch.bool),
            position_ids=torch.cat([torch.arange(m) for m in lens]),
            cu_seq_lens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]).int(),
            max_seq_len=max(lens),
            sample_index=idx,
        )

    return [pack([0, 3, 4]), pack([1, 2, 5])]


def logits_and_grads(model, pack: Pack) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = packed_logits(model, pack)  # [N, V]
    w = torch.linspace(-1, 1, logits.numel()).view_as(logits)  # a loss that reads every logit
    (logits * w).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same(a, b, tol: float) -> None:
    """Logits within ``tol``; each gradient within ``tol`` of its largest entry (fp32 sums of
    hundreds of terms in another order)."""
    assert (a[0] - b[0]).abs().max() < tol
    for x, y in zip(a[1], b[1], strict=True):
        assert (x - y).abs().max() <= tol * max(1.0, float(y.abs().max()))


def test_plain_rows_equal_the_dense_mask_path() -> None:
    """sdpa-varlen vs today's path (transformers' sdpa with the mask it builds from the
    restarting position_ids): logits and every parameter's gradient."""
    model = model_of()
    for row in grpo_rows():
        ours = logits_and_grads(model, row)
        reference = logits_and_grads(model, dataclasses.replace(row, attention=NATIVE))
        assert_same(ours, reference, 2e-6)


def test_shared_rows_equal_the_dense_mask_path() -> None:
    """sdpa-tree rows, merged (each branch repeats the prompt's last token) and not."""
    model = model_of()
    for row in share_prefixes(grpo_rows()).packs:
        assert row.attention == SDPA_TREE and row.merged is not None
        reference = logits_and_grads(model, dataclasses.replace(row, attention=DENSE))
        for variant in (row, dataclasses.replace(row, merged=None)):
            assert_same(logits_and_grads(model, variant), reference, 2e-6)


def test_activation_checkpointing_recomputes_with_the_same_kernel() -> None:
    """A checkpointed layer reruns its forward in the backward, outside packed_logits: the
    gradients still equal the dense path's."""
    model = model_of().train()  # checkpointing runs in train mode; dropout is 0 here
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for row in [grpo_rows()[0], *share_prefixes(grpo_rows()).packs]:
        dense = DENSE if hasattr(row, "tree_ids") else NATIVE
        ours = logits_and_grads(model, row)
        reference = logits_and_grads(model, dataclasses.replace(row, attention=dense))
        assert_same(ours, reference, 2e-6)


def test_a_wrong_segment_would_change_the_logits() -> None:
    """The tests above can fail: one segment spanning two samples lets the second see the
    first."""
    model = model_of()
    row = grpo_rows()[0]
    merged = dataclasses.replace(row, cu_seq_lens=row.cu_seq_lens[[0, 2, 3]])
    with torch.no_grad():
        a, b = packed_logits(model, row), packed_logits(model, merged)
    first = int(row.cu_seq_lens[1])
    # causal: the first sample is unaffected, up to the last bits of another call shape
    torch.testing.assert_close(a[:first], b[:first], atol=2e-6, rtol=0)
    assert (a[first:] - b[first:]).abs().max() > 1e-3  # 500x that tolerance


def test_no_dense_mask_is_built() -> None:
    """The reference path asks transformers for a [1, 1, N, N] mask; the kernels ask for none."""
    model = model_of()
    built: list[tuple[int, ...]] = []
    sdpa = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def spy(*args, **kwargs):
        mask = sdpa(*args, **kwargs)
        if mask is not None:
            built.append(tuple(mask.shape))
        return mask

    masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] = spy
    try:
        row = grpo_rows()[0]
        with torch.no_grad():
            packed_logits(model, dataclasses.replace(row, attention=NATIVE))
            n = len(row)
            assert built == [(1, 1, n, n)]  # the spy sees today's dense mask
            built.clear()
            packed_logits(model, row)
            for shared in share_prefixes(grpo_rows()).packs:
                packed_logits(model, shared)
            assert built == []
            # outside a segmented forward the mask function is transformers' again
            packed_logits(model, dataclasses.replace(row, attention=NATIVE))
            assert built == [(1, 1, n, n)]
    finally:
        masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] = sdpa


def test_generation_with_a_cache_is_unchanged() -> None:
    """segment_attention is registered as transformers' sdpa: without Segments it is sdpa
    itself (left-padded batch, KV cache), compared with eager attention on the same weights."""
    sdpa, eager = model_of("sdpa"), model_of("eager")
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    greedy = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        a = sdpa.generate(ids, **greedy, output_scores=True, return_dict_in_generate=True)
        b = eager.generate(ids, **greedy)
        la = sdpa(ids, attention_mask=mask).logits
        lb = eager(ids, attention_mask=mask).logits
    assert (la - lb)[mask.bool()].abs().max() < 1e-5
    # the tokens are the same where no near-tie lets 1e-5 decide them (here: all 4 steps)
    gaps = top_gaps(torch.stack(a.scores, dim=1))  # [2, 4]
    assert all(stable_length(row) == 4 for row in gaps), gaps
    assert torch.equal(a.sequences, b)


def test_pieces_worked_by_hand() -> None:
    plain = grpo_rows()[0]
    cu = plain.cu_seq_lens.tolist()
    assert pieces_of(plain) == [(a, a, a, e) for a, e in pairwise(cu)]
    # prompt 6 with responses of 2, 4, 6 tokens: shifted lengths 7, 9, 11, a prefix of 5
    # positions and branches of 2, 4, 6; prompt 4: prefix 3, branches 2, 4, 6. The larger
    # tree (17 positions) comes first, the other (15) after it.
    row = share_prefixes(grpo_rows(), max_len=64).packs[0]
    assert len(row) == 32
    assert pieces_of(row) == [
        *((0, 0, 0, 5), (0, 5, 5, 7), (0, 5, 7, 11), (0, 5, 11, 17)),
        *((17, 17, 17, 20), (17, 20, 20, 22), (17, 20, 22, 26), (17, 20, 26, 32)),
    ]


def test_segments_batch_similar_lengths_padded_at_the_end() -> None:
    """Prefixes of 5 and 3 positions run causally alone (5 and 3 are not within 5:4: two
    calls). Branch pieces (prefix + own positions) of 7, 9, 11 keys (tree 0) and 5, 7, 9
    (tree 1) group within 5:4 of the longest, 11 9 9 | 7 7 | 5, each padded by repeating its
    last position; they ask only their own positions' queries, under a mask that lets query
    i see keys j <= prefix + i."""
    row = share_prefixes(grpo_rows(), max_len=64).packs[0]
    seg = segments_of(row)
    assert [tuple(g.shape) for g in seg.groups] == [(1, 5), (1, 3), (3, 11), (2, 7), (1, 5)]
    assert [None if q is None else tuple(q.shape) for q in seg.queries] == [
        None, None, (3, 6), (2, 4), (1, 2),
    ]  # fmt: skip
    assert seg.masks[0] is None and seg.masks[1] is None
    assert seg.groups[2].tolist() == [
        [0, 1, 2, 3, 4, 11, 12, 13, 14, 15, 16],
        [0, 1, 2, 3, 4, 7, 8, 9, 10, 10, 10],
        [17, 18, 19, 26, 27, 28, 29, 30, 31, 31, 31],
    ]
    assert seg.queries[2].tolist() == [
        [11, 12, 13, 14, 15, 16],
        [7, 8, 9, 10, 10, 10],
        [26, 27, 28, 29, 30, 31],
    ]
    mask = seg.masks[2]  # [3, 1, 6, 11]: keys seen per query, prefix 5, 5 and 3
    assert mask.sum(-1)[:, 0].tolist() == [[6, 7, 8, 9, 10, 11], [6, 7, 8, 9, 10, 11],
                                           [4, 5, 6, 7, 8, 9]]  # fmt: skip
    # query 0 of tree 1's longest branch (position 26) sees its prefix 17..19 and itself
    assert seg.groups[2][2][mask[2, 0, 0]].tolist() == [17, 18, 19, 26]
    # every row position takes exactly one output, from a slot that holds it
    outs = [g if q is None else q for g, q in zip(seg.groups, seg.queries, strict=True)]
    flat = torch.cat([o.flatten() for o in outs])
    assert torch.equal(seg.query_index, flat)  # all groups' queries, gathered in one call
    assert torch.equal(seg.key_index, torch.cat([g.flatten() for g in seg.groups]))
    assert torch.equal(flat[seg.take], torch.arange(len(row)))
    assert seg.take.unique().numel() == len(row)


def test_segments_over_the_mask_budget_run_causally(monkeypatch) -> None:
    """A branch group whose mask would exceed MASK_BUDGET recomputes its prefix's queries
    under the causal kernel instead; logits and gradients still equal the dense path's."""
    row = share_prefixes(grpo_rows(), max_len=64).packs[0]
    monkeypatch.setattr(attention, "MASK_BUDGET", 0)
    seg = segments_of(row)
    assert all(q is None and m is None for q, m in zip(seg.queries, seg.masks, strict=True))
    assert [tuple(g.shape) for g in seg.groups] == [(1, 5), (1, 3), (3, 11), (2, 7), (1, 5)]
    model = model_of()
    reference = logits_and_grads(model, dataclasses.replace(row, attention=DENSE))
    assert_same(logits_and_grads(model, row), reference, 2e-6)


def test_flex_mask_mod_is_the_dense_mask() -> None:
    row = share_prefixes(grpo_rows(), max_len=64).packs[0]
    n = len(row)
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mod = tree_mask_mod(row.tree_ids, row.branch_ids)
    assert torch.equal(mod(0, 0, q, k), attention_allowed(row.tree_ids, row.branch_ids))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_forward_on_the_cpu() -> None:
    """flex_attention runs forward-only on the CPU (unfused): its BlockMask gives the
    dense-mask attention. Training uses it on CUDA only."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    row = share_prefixes(grpo_rows(), max_len=64).packs[0]
    n = len(row)
    mod = tree_mask_mod(row.tree_ids, row.branch_ids)
    block = create_block_mask(mod, None, None, n, n, device="cpu", BLOCK_SIZE=16)
    x = torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(0))
    dense = attention_allowed(row.tree_ids, row.branch_ids)
    with torch.no_grad():
        ours = flex_attention(x, x, x, block_mask=block)
    reference = F.scaled_dot_product_attention(x, x, x, attn_mask=dense)
    assert (ours - reference).abs().max() < 1e-5


@pytest.mark.parametrize(
    ("attn", "device", "kernels"),
    [
        ("sdpa", "cpu", (SDPA_VARLEN, SDPA_TREE)),
        ("sdpa", "cuda", (SDPA_VARLEN, FLEX_BLOCK)),
        ("flash_attention_2", "cuda:0", (FLASH_VARLEN, None)),
        ("flex_attention", "cpu", (NATIVE, None)),
        ("flex_attention", "cuda", (NATIVE, FLEX_BLOCK)),
        ("eager", "cpu", (NATIVE, DENSE)),
    ],
)
def test_choose_kernels(attn: str, device: str, kernels) -> None:
    assert choose_kernels(attn, device) == kernels


def test_unknown_attention_is_named() -> None:
    with pytest.raises(ValueError, match=r"model\.attn_implementation 'paged'"):
        choose_kernels("paged", "cpu")


def test_a_kernel_the_model_cannot_run_is_an_error() -> None:
    model = model_of()
    flex = [dataclasses.replace(p, attention=FLEX_BLOCK) for p in share_prefixes(grpo_rows()).packs]
    with pytest.raises(ValueError, match=r"pack 0 .*'flex-block'.*CUDA"):
        check_attention(model, flex)
    flash = [dataclasses.replace(grpo_rows()[0], attention=FLASH_VARLEN)]
    with pytest.raises(ValueError, match=r"flash_attention_\*"):
        check_attention(model, flash)
    check_attention(model, grpo_rows() + share_prefixes(grpo_rows()).packs)


def test_the_compile_exclusion_ends_with_its_context() -> None:
    """trainer.compile swaps in a never-compiled ``segment_attention`` for the compiled
    forwards only; afterwards the plain function is transformers' ``sdpa`` again."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is attention.segment_attention
    with attention.excluded_from_compile():
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is attention._UNCOMPILED
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is attention.segment_attention
