"""Shared-prompt decode attention (rltool/engines/hf_prompt_attention.py): each distinct prompt's
keys held once, its rows' queries read them grouped. It must equal plain attention over each
row's whole context (prompt columns then its own), for any mix of rows per prompt."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from test_hf_decode import _prompts, assert_recomputed
from transformers import AttentionInterface, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import SamplingConfig
from rltool.engines import hf_refill
from rltool.engines.hf import HFEngine
from rltool.engines.hf_prompt_attention import PROMPTS_KWARG, SharedPrompts, prompt_attention


def _case(heads: int, kv_heads: int):
    """3 prompts of 5, 2 and 0 real columns (left-padded to 5); 6 rows of them out of order,
    4 own columns each, some leading ones not attended."""
    gen = torch.Generator().manual_seed(0)
    u, p, t, d = 3, 5, 4, 8
    keep = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    pk, pv = (torch.randn(u, kv_heads, p, d, generator=gen) for _ in range(2))
    prompt_of = torch.tensor([0, 0, 2, 1, 0, 2])
    b = len(prompt_of)
    q = torch.randn(b, heads, 1, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, t, d, generator=gen) for _ in range(2))
    own = torch.ones(b, t, dtype=torch.bool)
    own[1, :2] = own[3, :1] = own[5, :3] = False
    prompts = SharedPrompts.of_rows([pk], [pv], keep, prompt_of)
    return q, k, v, own, prompts


def _plain(q, k, v, own, prompts, rows) -> torch.Tensor:
    """Each row on its own: SDPA over its prompt's columns then its own. [b, 1, H, D]"""
    outs = []
    for r in rows:
        j = prompts.prompt_of[r]
        keys = torch.cat([prompts.keys[0][j], k[r]], 1)[None]  # [1, K, P + T, D]
        values = torch.cat([prompts.values[0][j], v[r]], 1)[None]
        mask = torch.cat([prompts.keep[j], own[r]])[None, None, None]  # [1, 1, 1, P + T]
        n_rep = q.shape[1] // k.shape[1]
        outs.append(
            F.scaled_dot_product_attention(
                q[r, None], repeat_kv(keys, n_rep), repeat_kv(values, n_rep), attn_mask=mask
            )
        )
    return torch.cat(outs).transpose(1, 2)


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 2), (4, 1)])
def test_grouped_rows_equal_attention_over_each_rows_whole_context(heads, kv_heads):
    q, k, v, own, prompts = _case(heads, kv_heads)
    layer = types.SimpleNamespace(layer_idx=0)
    got, _ = prompt_attention(layer, q, k, v, own[:, None, None], **{PROMPTS_KWARG: prompts})
    torch.testing.assert_close(got, _plain(q, k, v, own, prompts, range(6)), atol=1e-6, rtol=0)
    assert prompts.per_prompt == 3 and prompts.calls == 1
    # a subset of the rows, as a compaction keeps them, on its own grid
    rows = torch.tensor([1, 2, 3])
    sub = SharedPrompts.of_rows(prompts.keys, prompts.values, prompts.keep, prompts.prompt_of[rows])
    got, _ = prompt_attention(
        layer, q[rows], k[rows], v[rows], own[rows, None, None], **{PROMPTS_KWARG: sub}
    )
    want = _plain(q, k, v, own, prompts, rows.tolist())
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_the_loop_shares_prompts_where_rows_are_many_and_prompts_few():
    group = [[1, 2, 3]] * 4 + [[4, 5]] * 4
    assert hf_refill.shares_prompts(group * 16, slots=128)  # 128 rows, 4 a prompt
    assert not hf_refill.shares_prompts(group * 16, slots=64)  # too few rows a step
    assert not hf_refill.shares_prompts([[i, 1] for i in range(256)], slots=256)  # all distinct
    assert not hf_refill.shares_prompts(group * 8, slots=256)  # 64 prompts in all


@pytest.fixture
def shared(monkeypatch):
    """The refill loop shares prompts whatever the size."""
    monkeypatch.setattr(hf_refill, "shares_prompts", lambda _prompts, _slots: True)


@pytest.mark.usefixtures("shared")
def test_sampled_groups_on_a_grouped_query_model_keep_their_logprobs(tokenizer):
    """Groups of 4 over 5 prompts, 8 slots (refills and compactions), 2 query heads a key head:
    every sampled row's logprobs equal a full recomputation of its own sequence."""
    cfg = demo_model_config(tokenizer, 32, 2, 4, 64)
    cfg.num_key_value_heads = 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(cfg).eval()
    prompts = [p for p in _prompts(tokenizer, [6, 3, 8, 1, 5], seed=4) for _ in range(4)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    torch.manual_seed(0)
    gens = HFEngine(model, tokenizer, batch_size=8, slots=8).generate(prompts, sampling)
    assert_recomputed(model, tokenizer, prompts, gens, sampling)
    assert len({tuple(g.token_ids) for g in gens[:4]}) > 1  # a group's rows differ


@pytest.mark.usefixtures("shared")
def test_a_replaced_sdpa_function_fails_the_decode_loudly(tokenizer):
    """An ``sdpa`` registration that ignores the shared prompts would attend to the rows' own
    columns only; the decoder counts the layers served and stops."""
    model = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 2, 2, 64)).eval()
    engine = HFEngine(model, tokenizer, batch_size=4, slots=4)
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register("sdpa", sdpa_attention_forward)
    try:
        with pytest.raises(RuntimeError, match="shared-prompt attention was skipped"):
            engine.generate([[5, 6, 7]] * 2, SamplingConfig(temperature=0.0, max_new_tokens=2))
    finally:
        AttentionInterface.register("sdpa", before)
