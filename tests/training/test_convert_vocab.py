"""Conversion with the policy's vocabulary known: a group holding a token id at or past the
embedding rows is skipped as invalid and counted (never an IndexError in the trainer), and
skipped groups are logged once per reason and kind, not once per group (issue 21, 3 and 8)."""

from __future__ import annotations

import logging

from test_convert import make
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import RecipeConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.models import embedding_rows
from rltool.training.convert import ConversionConfig, convert_groups

V = 50


def _group(gid: str, last: int) -> list:
    return [
        make(f"{gid}/0", [1, 2], [3, last], [1, 1], [-0.1, -0.2], score=1.0, gid=gid),
        make(f"{gid}/1", [1, 2], [3, 4], [1, 1], [-0.1, -0.2], score=0.0, gid=gid),
    ]


def test_an_id_past_the_embedding_rows_skips_its_group_and_is_counted() -> None:
    groups = [_group("bad", V), _group("edge", V - 1)]
    batch = convert_groups(groups, ConversionConfig(pack_max_length=16, vocab_size=V))
    (skip,) = batch.skipped_groups
    assert (skip.group_id, skip.reason, skip.kind) == (
        "bad", "invalid", "contract: token ids in the vocabulary"
    )  # fmt: skip
    assert skip.detail == f"bad/0: input_ids[3]: token id {V} outside the vocabulary [0, {V}) " \
        "(invariant 10)"  # fmt: skip
    assert batch.data_info["data/skipped/invalid"] == 1.0
    assert [s.rollout_id for s in batch.samples] == ["edge/0", "edge/1"]
    assert all(int(p.input_ids.max()) < V for p in batch.packs)  # what the embedding reads
    # unknown vocabulary: the id goes through, as before (the recipe-built run knows it)
    assert convert_groups(groups, ConversionConfig(pack_max_length=16)).skipped_groups == []


def test_the_run_knows_the_policys_embedding_rows() -> None:
    tokenizer = train_demo_tokenizer()
    model = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 1, 2, 64))
    assert embedding_rows(model) == model.config.vocab_size == len(tokenizer)
    model.resize_token_embeddings(len(tokenizer) + 13)  # padded rows, as Qwen checkpoints have
    assert embedding_rows(model) == len(tokenizer) + 13
    recipe = RecipeConfig()
    assert ConversionConfig.from_recipe(recipe, vocab_size=77).vocab_size == 77
    assert ConversionConfig.from_recipe(recipe).vocab_size is None


def test_skipped_groups_are_logged_once_per_reason_and_kind(caplog) -> None:
    def nan_group(gid: str) -> list:
        return [
            make(f"{gid}/0", [1], [2, 3], [1, 1], [-0.1, float("nan")], score=1.0, gid=gid),
            make(f"{gid}/1", [1], [2, 3], [1, 1], [-0.1, -0.2], score=0.0, gid=gid),
        ]

    groups = [nan_group("a"), nan_group("b"), _group("c", V), nan_group("d")]
    with caplog.at_level(logging.WARNING, logger="rltool.training.convert"):
        batch = convert_groups(groups, ConversionConfig(pack_max_length=16, vocab_size=V))
    assert batch.data_info["data/skipped/invalid"] == 4.0
    assert [r.getMessage() for r in caplog.records] == [
        "skipping 3 groups: invalid, contract: logprobs finite (first: group a: a/0: "
        "logprobs[2]: not finite (nan) (invariant 4))",
        "skipping 1 group: invalid, contract: token ids in the vocabulary (first: group c: "
        f"c/0: input_ids[3]: token id {V} outside the vocabulary [0, {V}) (invariant 10))",
    ]
