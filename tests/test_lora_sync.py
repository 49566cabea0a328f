"""What a weight sync sends (rltool/lora_sync.py): a LoRA policy's adapters in peft's format
to an engine that takes them, merged weights to every other; the bytes of each."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import random_qwen2

from rltool.config.schema import LoraConfig
from rltool.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, apply_lora, engine_model, merged_copy
from rltool.lora_sync import (
    PEFT_PREFIX,
    AdapterPayload,
    adapter_payload,
    rollout_weights,
    weights_nbytes,
    write_adapter,
)

VOCAB = 40
# random_qwen2: hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads (k/v out = 32)
IN_OUT = {
    "q_proj": (64, 64),
    "k_proj": (64, 32),
    "v_proj": (64, 32),
    "o_proj": (64, 64),
    "gate_proj": (64, 128),
    "up_proj": (64, 128),
    "down_proj": (128, 64),
}


def _policy(rank: int = 4, alpha: float = 8, **kw) -> torch.nn.Module:
    """The tiny Qwen2 with adapters on every projection, B random (the adapters matter)."""
    policy = apply_lora(random_qwen2(VOCAB, seed=0), LoraConfig(rank=rank, alpha=alpha, **kw))
    torch.manual_seed(1)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return policy.eval()


@pytest.mark.parametrize("held", ["peft model", "base model (shared engine)"])
def test_payload_names_shapes_and_config(held):
    policy = _policy()
    payload = adapter_payload(policy if held == "peft model" else engine_model(policy))
    assert isinstance(payload, AdapterPayload)
    assert len(payload.tensors) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for layer in range(2):
        for module, (fan_in, fan_out) in IN_OUT.items():
            part = (
                "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            )
            stem = f"{PEFT_PREFIX}model.layers.{layer}.{part}.{module}"
            assert payload.tensors[f"{stem}.lora_A.weight"].shape == (4, fan_in)
            assert payload.tensors[f"{stem}.lora_B.weight"].shape == (fan_out, 4)
    cfg = payload.config
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == (
        "LORA",
        4,
        8,
        False,
    )
    assert cfg["target_modules"] == sorted(IN_OUT)
    # peft's own save names: what vLLM's LoRA loader reads
    from peft import get_peft_model_state_dict

    peft_names = get_peft_model_state_dict(policy)
    assert set(payload.tensors) == set(peft_names)
    for k, v in peft_names.items():
        assert torch.equal(payload.tensors[k], v)
    # rank 4 on (in + out) of each projection, 2 layers, fp32: 2 * 4 * 1024 * 4 bytes
    assert sum(fan_in + fan_out for fan_in, fan_out in IN_OUT.values()) == 1024
    assert weights_nbytes(payload) == 2 * 4 * 1024 * 4 == 32768


def test_rollout_weights_adapters_only_where_the_engine_takes_them(caplog):
    policy = _policy()
    merged = rollout_weights(policy, takes_adapters=False)
    assert not isinstance(merged, AdapterPayload)
    assert not any(".lora_" in k for k in merged)  # the base names, adapters folded in
    # a model's parameters, each once: what the merged state dict moves
    full = sum(p.numel() * 4 for p in merged_copy(policy).parameters())
    assert weights_nbytes(merged) == full
    assert isinstance(rollout_weights(policy, takes_adapters=True), AdapterPayload)
    plain = random_qwen2(VOCAB, seed=0)  # no adapters: the weights as they are, no warning
    with caplog.at_level("WARNING"):
        sent = rollout_weights(plain, takes_adapters=True)
    assert set(sent) == set(plain.state_dict())
    assert caplog.records == []


def test_an_adapter_vllm_cannot_take_goes_merged_with_the_reason(caplog):
    """One rank for every layer is what one adapter config says: peft's rank_pattern
    (another rank for q_proj) cannot go as an adapter, so the merged weights go."""
    import peft

    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern={"q_proj": 2}
    )
    policy = peft.get_peft_model(random_qwen2(VOCAB, seed=0), cfg)
    reason = adapter_payload(policy)
    assert reason == "layers differ in rank [2, 4] or alpha [8]"
    with caplog.at_level("WARNING"):
        sent = rollout_weights(policy, takes_adapters=True)
    assert not isinstance(sent, AdapterPayload)
    assert set(sent) == set(random_qwen2(VOCAB, seed=0).state_dict())
    assert "sending merged weights instead of adapters" in caplog.text


def test_weights_nbytes_counts_a_tied_head_once():
    emb = torch.zeros(10, 4)
    assert weights_nbytes({"embed": emb, "lm_head": emb, "norm": torch.zeros(4)}) == 44 * 4


def test_written_adapter_loads_in_peft_and_computes_the_policy(tmp_path):
    """The folder is peft's format: peft loads it onto the base and gets the policy's
    logits (what vLLM's loader reads from the same two files)."""
    from peft import PeftModel

    policy = _policy(rank=8, alpha=4)
    payload = adapter_payload(policy)
    folder = write_adapter(payload, tmp_path / "adapter_0")
    assert sorted(p.name for p in folder.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])
    assert json.loads((folder / ADAPTER_CONFIG).read_text())["r"] == 8
    assert set(load_file(folder / ADAPTER_WEIGHTS)) == set(payload.tensors)
    loaded = PeftModel.from_pretrained(copy.deepcopy(random_qwen2(VOCAB, seed=0)), folder).eval()
    ids = torch.arange(12)[None] % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, policy(ids).logits, rtol=0, atol=1e-6)
    assert [p.name for p in tmp_path.iterdir()] == ["adapter_0"]  # no temporary left
