"""LoRA on the policy (rltool/lora.py): only adapters train, the rollout side gets
base + adapters (shared model, or merged weights under the base names), the KL reference
is the base, checkpoints hold adapters."""

from __future__ import annotations

import builtins
import copy
from pathlib import Path

import pytest
import torch
from tiny_models import random_qwen2

from rltool.config.loader import load_recipe
from rltool.config.schema import LoraConfig, OptimizerConfig
from rltool.lora import (
    ADAPTER_WEIGHTS,
    AdapterFreeReference,
    apply_lora,
    engine_model,
    load_checkpoint_weights,
    merged_copy,
    require_peft,
    rollout_state_dict,
)
from rltool.training.optim import build_optimizer

VOCAB = 40


def _lora_policy(seed: int = 0, rank: int = 4, **kw) -> torch.nn.Module:
    """A tiny Qwen2 with LoRA adapters whose B is random (not the zero start), so that the
    adapters change the logits."""
    model = apply_lora(random_qwen2(VOCAB, seed=seed, **kw), LoraConfig(rank=rank, alpha=8))
    torch.manual_seed(seed + 100)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model.eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def test_only_adapters_have_grad_and_reach_the_optimizer():
    policy = _lora_policy().train()
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x 7 linear projections x (A, B)
    assert len(trainable) == 2 * 7 * 2
    optimizer = build_optimizer(policy, OptimizerConfig(lr=1e-3))
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in policy.parameters() if p.requires_grad}
    policy(input_ids=_ids()).logits.logsumexp(-1).mean().backward()
    with_grad = {n for n, p in policy.named_parameters() if p.grad is not None}
    assert with_grad == trainable


def test_zero_init_adapters_compute_the_base_model():
    base = random_qwen2(VOCAB, seed=3).eval()
    expected = _logits(base)
    policy = apply_lora(copy.deepcopy(base), LoraConfig(rank=4, alpha=8)).eval()
    assert torch.equal(_logits(policy), expected)  # B = 0: the adapters add exactly 0


def test_rollout_state_dict_is_merged_under_the_base_names_and_leaves_the_policy_alone():
    plain = random_qwen2(VOCAB, seed=0)
    policy = _lora_policy(seed=0)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    weights = rollout_state_dict(policy)
    assert set(weights) == set(plain.state_dict())
    plain.load_state_dict(weights, strict=True)
    torch.testing.assert_close(_logits(plain.eval()), _logits(policy), atol=1e-5, rtol=0)
    # W + scale * B @ A by hand, for one projection (scale = alpha / rank = 2)
    q = policy.get_base_model().model.layers[0].self_attn.q_proj
    by_hand = q.base_layer.weight + 2.0 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], by_hand)
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing merged in place
    assert set(after) == set(before)
    # the base model a shared engine holds (peft's layers inside) gives the same weights
    from_base = rollout_state_dict(engine_model(policy))
    assert set(from_base) == set(weights)
    # bit-equal: both merge the same tensors with the same operations
    assert all(torch.equal(from_base[k], weights[k]) for k in weights)


def test_merged_copy_and_engine_model():
    policy = _lora_policy(seed=2)
    merged = merged_copy(policy)
    assert type(merged).__name__ == "Qwen2ForCausalLM"
    assert set(merged.state_dict()) == set(random_qwen2(VOCAB).state_dict())
    torch.testing.assert_close(_logits(merged.eval()), _logits(policy), atol=1e-5, rtol=0)
    assert engine_model(policy) is policy.get_base_model()  # the live adapter layers
    torch.testing.assert_close(_logits(engine_model(policy)), _logits(policy))
    plain = random_qwen2(VOCAB)
    assert engine_model(plain) is plain


def test_reference_is_the_base_model_without_a_copy_and_keeps_the_policy_mode():
    base_logits = _logits(random_qwen2(VOCAB, seed=0).eval())
    policy = _lora_policy(seed=0).train()
    ref = AdapterFreeReference(policy)
    assert not list(ref.children())  # the policy is not its submodule: no second copy
    assert next(ref.parameters()) is next(policy.parameters())  # its device
    ref.eval()
    assert policy.training  # eval() on the reference leaves the policy in train mode
    policy.eval()
    torch.testing.assert_close(_logits(ref), base_logits, atol=1e-6, rtol=0)
    assert (_logits(policy) - base_logits).abs().max() > 1e-2  # the adapters are back on


def test_checkpoint_adapters_load_into_a_fresh_policy(tmp_path):
    trained = _lora_policy(seed=0)
    trained.save_pretrained(tmp_path, safe_serialization=True)  # what save_checkpoint calls
    assert (tmp_path / ADAPTER_WEIGHTS).is_file()
    assert not (tmp_path / "model.safetensors").exists()  # adapters only
    fresh = apply_lora(random_qwen2(VOCAB, seed=0), LoraConfig(rank=4, alpha=8)).eval()
    load_checkpoint_weights(fresh, tmp_path)
    assert torch.equal(_logits(fresh), _logits(trained))  # the same weights, the same forward


def test_checkpoint_mismatches_are_named(tmp_path):
    _lora_policy(rank=4).save_pretrained(tmp_path / "r4")
    other_rank = apply_lora(random_qwen2(VOCAB), LoraConfig(rank=2, alpha=8))
    with pytest.raises(ValueError, match=r"r4/adapter_model.safetensors: .*do not match.*size"):
        load_checkpoint_weights(other_rank, tmp_path / "r4")
    plain = random_qwen2(VOCAB)
    with pytest.raises(ValueError, match=r"holds LoRA adapters.*model\.lora\.enabled: true"):
        load_checkpoint_weights(plain, tmp_path / "r4")
    plain.save_pretrained(tmp_path / "full")
    with pytest.raises(ValueError, match=r"no adapter_model\.safetensors.*saved without LoRA"):
        load_checkpoint_weights(_lora_policy(), tmp_path / "full")


def test_target_modules_match_as_peft_does():
    by_path = apply_lora(random_qwen2(VOCAB), LoraConfig(target_modules=["self_attn.q_proj"]))
    trainable = {n for n, p in by_path.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 2 and all("q_proj" in n for n in trainable)


def test_unknown_target_module_lists_the_linear_layers():
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules: \['qkv'\].*'q_proj'"):
        apply_lora(random_qwen2(VOCAB), LoraConfig(target_modules=["q_proj", "qkv"]))


def test_lora_ranges_are_checked_when_the_recipe_loads():
    recipe = Path(__file__).parents[1] / "recipes" / "gsm8k_tiny_lora.yaml"
    with pytest.raises(ValueError) as info:
        load_recipe(recipe, ["model.lora.rank=0", "model.lora.dropout=1", "model.lora.alpha=0"])
    for line in (
        "model.lora.rank = 0: must be >= 1",
        "model.lora.alpha = 0: must be > 0",
        "model.lora.dropout = 1: must be in [0, 1)",
    ):
        assert line in str(info.value)


def test_missing_peft_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(ValueError, match=r"pip install 'rltool\[lora\]'"):
        require_peft()
