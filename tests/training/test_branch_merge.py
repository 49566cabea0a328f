"""Branches merged where they begin alike: the trie worked by hand, and logits and every
gradient equal to the unmerged row's dense-mask reference."""

from __future__ import annotations

import dataclasses
from itertools import pairwise
from unittest.mock import patch

import torch
from test_attention import assert_same, logits_and_grads, model_of

from rltool.training.attention import DENSE, SDPA_TREE
from rltool.training.batch import Pack
from rltool.training.branch_merge import merge_branches
from rltool.training.layout.shared_prefix import share_prefixes

PROMPT = [11, 12, 13, 14, 15]
# responses of one prompt: 0 and 3 the same, 1 opens like 0, 2 shares one token, 4 none
RESPONSES = [[21, 22, 23], [21, 22, 24, 25], [21, 26], [21, 22, 23], [27, 28]]


def row_of(samples: list[tuple[list[int], list[int]]]) -> Pack:
    """One plain row of (prompt, response) samples; a sample's targets are -100 over the
    prompt but its last token, then the response (an empty response: no loss)."""
    ids, targets, positions, cu = [], [], [], [0]
    for prompt, response in samples:
        seq = prompt + response
        ids += seq[:-1]
        targets += [-100] * (len(prompt) - 1) + response
        positions += list(range(len(seq) - 1))
        cu.append(len(ids))
    n = len(ids)
    return Pack(
        input_ids=torch.tensor(ids),
        targets=torch.tensor(targets),
        advantages=torch.zeros(n),
        rollout_logprobs=torch.zeros(n),
        has_rollout_logprobs=torch.ones(n, dtype=torch.bool),
        position_ids=torch.tensor(positions),
        cu_seq_lens=torch.tensor(cu).int(),
        max_seq_len=max(b - a for a, b in pairwise(cu)),
        sample_index=list(range(len(samples))),
    )


def test_trie_worked_by_hand() -> None:
    """Branches (the prompt's last token, then the response but its last token):
    [15 21 22] [15 21 22 24] [15 21] [15 21 22] [15 27]: a trie 15 -> 21 -> 22 -> 24 and
    15 -> 27, after the prefix 11..14. Depth-first: prefix at 0..3, 15 21 22 24 at 4..7 (one
    piece), 27 at 8 (a piece whose earlier keys are the prefix and 15)."""
    row = share_prefixes([row_of([(PROMPT, r) for r in RESPONSES])]).packs[0]
    assert len(row) == 4 + 3 + 4 + 2 + 3 + 2
    merged = merge_branches(row)
    assert merged is not None
    assert row.input_ids[merged.rep].tolist() == [11, 12, 13, 14, 15, 21, 22, 24, 27]
    assert merged.node_of.tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 4, 5, 4, 5, 6, 4, 8]
    # every position computes from a merged position with its token and its position id
    assert torch.equal(row.input_ids[merged.rep][merged.node_of], row.input_ids)
    assert torch.equal(row.position_ids[merged.rep][merged.node_of], row.position_ids)
    assert [(k.tolist(), a, e) for k, a, e in merged.pieces] == [
        ([], 0, 4),
        ([0, 1, 2, 3], 4, 8),
        ([0, 1, 2, 3, 4], 8, 9),
    ]


def test_merged_rows_equal_the_dense_mask_path() -> None:
    """Two prompts with alike and identical answers, and a sample without loss (no prefix,
    so no tree to merge in): the merged forward's logits and every parameter's gradient
    equal the dense reference of the unmerged row."""
    other = [7, 8, 9]
    samples = [(PROMPT, r) for r in RESPONSES] + [(other, [31, 32]), (other, [31, 33, 34])]
    samples.append(([41, 42, 43], []))
    model = model_of()
    for row in share_prefixes([row_of(samples)]).packs:
        assert row.attention == SDPA_TREE  # laid out merged: the forward runs merged
        assert row.merged is not None and len(row.merged.rep) < len(row)
        ours = logits_and_grads(model, row)
        reference = logits_and_grads(model, dataclasses.replace(row, attention=DENSE))
        assert_same(ours, reference, 2e-6)


def test_nothing_to_merge_or_recorded_routing_keeps_the_row() -> None:
    """One answer per prompt merges nothing; a row that replays recorded MoE routing (per
    row position) is never merged."""
    single = share_prefixes([row_of([(PROMPT, [21, 22]), ([7, 8], [31])])]).packs[0]
    assert merge_branches(single) is None
    row = share_prefixes([row_of([(PROMPT, r) for r in RESPONSES])]).packs[0]
    routed = dataclasses.replace(row, routed_experts=torch.zeros(len(row), 2, 1, dtype=torch.long))
    assert merge_branches(routed) is None


def test_the_head_makes_the_rows_logits_from_copied_out_hidden_states() -> None:
    """The LM head runs on the row's N positions (the merged hidden states copied out), so no
    [M, V] logits are made beside the [N, V] ones; a model without output embeddings gets the
    merged logits copied out instead. Both equal, logits and gradients."""
    model = model_of()
    row = share_prefixes([row_of([(PROMPT, r) for r in RESPONSES])]).packs[0]
    shapes: list[tuple[int, ...]] = []
    head = model.get_output_embeddings()
    spy = head.register_forward_hook(lambda _m, _args, out: shapes.append(tuple(out.shape)))
    try:
        ours = logits_and_grads(model, row)
    finally:
        spy.remove()
    assert shapes == [(1, len(row), head.out_features)]
    with patch.object(type(model), "get_output_embeddings", lambda _self: None):
        copied = logits_and_grads(model, row)
    assert_same(ours, copied, 1e-6)
