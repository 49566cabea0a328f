"""``rollout.engine: vllm`` in the main environment (no vLLM): its options, their checks,
the error that says how to get vLLM, and the pure helpers. The engine itself is tested
where vLLM is installed: tests/vllm_env/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rltool.config.loader import load_recipe
from rltool.config.schema import ModelConfig, RolloutConfig, VLLMConfig
from rltool.engines.base import eos_ids
from rltool.engines.chunked import first_stop
from rltool.engines.registry import ENGINES, build_engine
from rltool.engines.vllm import llm_options
from rltool.engines.vllm_worker import EXTENSION

REPO = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_vllm_is_a_known_engine_without_importing_vllm():
    ENGINES.get("vllm")
    assert {"hf", "vllm"} <= set(ENGINES.names())


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_says_how_to_get_it(tiny_checkpoint):
    rollout = RolloutConfig(engine="vllm")
    with pytest.raises(ValueError, match=r"needs vLLM.*bash scripts/vllm_env.sh"):
        build_engine(rollout, ModelConfig(path=str(tiny_checkpoint)), None, None)


def test_llm_options_follow_the_recipe(tmp_path):
    cfg = VLLMConfig(gpu_memory_utilization=0.3, enforce_eager=False, max_model_len=256)
    opts = llm_options(cfg, ModelConfig(dtype="bfloat16"), tmp_path)
    assert opts["model"] == str(tmp_path)
    assert opts["dtype"] == "bfloat16"  # "" takes model.dtype: the trainer's precision
    assert (opts["gpu_memory_utilization"], opts["enforce_eager"]) == (0.3, False)
    assert (opts["max_model_len"], opts["tensor_parallel_size"], opts["seed"]) == (256, 1, 0)
    assert opts["enable_prefix_caching"] is True
    assert opts["logprobs_mode"] == "processed_logprobs"
    assert opts["worker_extension_cls"] == EXTENSION
    assert llm_options(VLLMConfig(dtype="float16"), ModelConfig(), tmp_path)["dtype"] == "float16"


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("rollout.vllm.gpu_memory_utilization=0",
         "rollout.vllm.gpu_memory_utilization = 0: must be in (0, 1]"),
        ("rollout.vllm.gpu_memory_utilization=1.5",
         "rollout.vllm.gpu_memory_utilization = 1.5: must be in (0, 1]"),
        ("rollout.vllm.tensor_parallel_size=0",
         "rollout.vllm.tensor_parallel_size = 0: must be >= 1"),
        ("rollout.vllm.max_model_len=0", "rollout.vllm.max_model_len = 0: must be >= 1 or null"),
        ("rollout.vllm.seed=-1", "rollout.vllm.seed = -1: must be >= 0"),
        ("model.lora.sync=full",
         "model.lora.sync = 'full': must be one of: adapters, merged"),
    ],
)  # fmt: skip
def test_vllm_options_are_range_checked(override, line):
    recipe = REPO / "recipes" / "gsm8k_tiny_vllm.yaml"
    with pytest.raises(ValueError) as err:
        load_recipe(recipe, [override])
    assert str(err.value) == f"recipe {recipe}: {line}"


def test_the_vllm_recipe_loads():
    cfg = load_recipe(REPO / "recipes" / "gsm8k_tiny_vllm.yaml")
    assert cfg.rollout.engine == "vllm"
    assert cfg.rollout.vllm == VLLMConfig()  # the defaults, written out


def test_first_stop_finds_a_stop_string_split_across_calls(tokenizer):
    tokens = tokenizer.encode("12 + 3 = 15\n#### 15", add_special_tokens=False)
    cut = first_stop(tokenizer, tokens, ["####"], 0)
    assert cut is not None
    assert "####" in tokenizer.decode(tokens[:cut])
    assert "####" not in tokenizer.decode(tokens[: cut - 1])
    assert first_stop(tokenizer, tokens, ["nope"], 0) is None
    assert first_stop(tokenizer, tokens, [], 0) is None


def test_eos_ids_join_the_tokenizer_and_the_generation_config(tokenizer):
    from types import SimpleNamespace

    model = SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=[7, tokenizer.eos_token_id])
    )
    assert eos_ids(tokenizer, model) == sorted({7, tokenizer.eos_token_id})
    assert eos_ids(tokenizer, None) == [tokenizer.eos_token_id]


def test_a_lora_run_starts_vllm_with_adapters_of_its_rank(tmp_path):
    from rltool.config.schema import LoraConfig
    from rltool.engines.vllm import vllm_lora_rank

    model_cfg = ModelConfig(lora=LoraConfig(enabled=True, rank=16))
    opts = llm_options(VLLMConfig(), model_cfg, tmp_path)
    assert (opts["enable_lora"], opts["max_lora_rank"], opts["max_loras"]) == (True, 16, 1)
    assert "enable_lora" not in llm_options(VLLMConfig(), ModelConfig(), tmp_path)
    merged = ModelConfig(lora=LoraConfig(enabled=True, rank=16, sync="merged"))
    assert "enable_lora" not in llm_options(VLLMConfig(), merged, tmp_path)  # base kernels
    # vLLM takes ranks 1, 8, 16, 32, ...: the smallest that holds the recipe's
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match=r"model.lora.rank = 513: .* at most 512"):
        vllm_lora_rank(513)
