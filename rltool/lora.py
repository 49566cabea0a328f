"""LoRA adapters on the policy (``model.lora``, with ``peft``: ``pip install 'rltool[lora]'``).

The trainer's model becomes a ``PeftModel`` whose base weights are frozen. What the rollout
side sees: every engine generates with plain weights. An engine that holds its own copy
(``load_weights``, and the ``sync_weights`` of vLLM and the server engine) receives what
``rltool.lora_sync.rollout_weights`` picks: the adapters where the engine loads LoRA adapters
(vLLM with ``enable_lora``), else :func:`rollout_state_dict`, the merged weights
``W + scale * B @ A`` under the base model's own names (the trainer's model is not changed).
The HF engine handed the shared model in process generates on a plain merged copy
(:func:`merged_copy`) that its ``sync_weights`` refreshes, so no peft layer sits in its
decode loop. The KL reference is the same model with its adapters switched off
(:class:`AdapterFreeReference`): no second copy. Design: docs/lora.md
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rltool.config.schema import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's save_pretrained format
ADAPTER_CONFIG = "adapter_config.json"
_INSTALL = "pip install 'rltool[lora]'"


def require_peft() -> Any:
    """The ``peft`` module, or a ValueError naming the extra to install."""
    try:
        import peft
    except ImportError as exc:
        raise ValueError(
            f"model.lora.enabled needs the peft package, which is not installed: {_INSTALL}"
        ) from exc
    return peft


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a peft-wrapped policy (peft is not imported to find out: a run
    that never imported it has no peft model)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` wrapped in fresh adapters (B = 0, so it computes what it did); every base
    weight frozen, only the adapters train. ``model`` itself gets the adapter layers."""
    peft = require_peft()
    names = [n for n, _ in model.named_modules()]
    # peft's rule: a target names a module whose path is it or ends with "." + it
    missing = [t for t in cfg.target_modules if not any(_matches(n, t) for n in names)]
    if not cfg.target_modules or missing:
        raise ValueError(
            f"model.lora.target_modules: {missing or '[]'} name no module of the model; its "
            f"linear layers are {sorted(_linear_names(model))}"
        )
    config = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def _matches(module_path: str, target: str) -> bool:
    return module_path == target or module_path.endswith("." + target)


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n
    }


def engine_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model an engine sharing ``model`` generates with: a peft
    model's base model, which carries the live adapter layers."""
    return model.get_base_model() if is_lora(model) else model


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, layer) of every peft LoRA layer in ``model`` (a peft model, or the base model
    a shared engine holds), in module order. It imports peft: where peft may be absent,
    ask :func:`has_lora_layers` first."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


@torch.no_grad()
def rollout_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights every engine that holds its own copy loads (the one place that knows
    about LoRA): ``model.state_dict()``, or, for a peft model or the base model a shared
    engine holds (``engine_model``: peft's layers inside), the merged weights (base +
    scale * B @ A of the active adapters) under the base model's parameter names. The
    trainer's model is not changed."""
    base = engine_model(model)
    state = base.state_dict()
    if "peft" not in sys.modules or not any(".lora_" in key for key in state):
        return state  # no adapters: the weights as they are
    deltas: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(base):
        if layer.disable_adapters or layer.merged:  # adapters off, or already in the weight
            continue
        for adapter in layer.active_adapters:
            delta = layer.get_delta_weight(adapter)  # scale * B @ A, [out, in]
            key = f"{name}.weight"
            deltas[key] = deltas[key] + delta if key in deltas else delta
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:  # lora_A, lora_B, lora_dropout, lora_embedding_*
            continue
        base_key = key.replace(".base_layer.", ".")
        delta = deltas.get(base_key)
        out[base_key] = value if delta is None else value + delta.to(value.dtype)
    return out


def has_lora_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs peft LoRA layers: a peft model, or the base model a shared
    engine holds (``engine_model``)."""
    return "peft" in sys.modules and next(lora_layers(model), None) is not None


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain transformers model with the adapters folded in (``model`` unchanged): of a
    peft model, or of a base model with peft's layers inside (each replaced by its base
    layer, which then takes the merged weights)."""
    if is_lora(model):
        return copy.deepcopy(model).merge_and_unload()
    out = copy.deepcopy(model)
    if not has_lora_layers(out):
        return out
    for name, layer in list(lora_layers(out)):
        parent, _, child = name.rpartition(".")
        setattr(out.get_submodule(parent), child, layer.get_base_layer())
    out.load_state_dict(rollout_state_dict(model), strict=True)
    return out


class AdapterFreeReference(torch.nn.Module):
    """The KL reference of a LoRA policy: the policy's own forward with its adapters
    switched off, i.e. the frozen base model, without a second copy of it.

    The policy is held outside the module tree, so ``train()``/``eval()`` on the reference
    never flips the policy's mode; ``parameters()`` are the policy's (for its device)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        if not is_lora(policy):
            raise ValueError("AdapterFreeReference needs a peft (LoRA) policy")
        self._policy = (policy,)  # a tuple: not registered as a submodule

    @property
    def config(self) -> Any:
        return self._policy[0].config

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self._policy[0].parameters(recurse)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy = self._policy[0]
        with policy.disable_adapter():
            return policy(*args, **kwargs)


def load_adapter_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """Load the adapters a checkpoint saved (peft's format) into a peft ``model``; every
    adapter weight must be there (a checkpoint of another rank or target list fails)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = ckpt / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ValueError(
            f"{ckpt}: no {ADAPTER_WEIGHTS}; model.lora.enabled is set but this checkpoint "
            "holds full weights (it was saved without LoRA)"
        )
    weights = load_file(str(path))
    expected = {k for k in model.state_dict() if ".lora_" in k}
    mismatch = f"{path}: the adapters do not match model.lora (rank, target_modules)"
    try:
        result = set_peft_model_state_dict(model, weights)
    except RuntimeError as exc:  # a tensor of another shape (another rank)
        raise ValueError(f"{mismatch}: {str(exc).splitlines()[-1].strip()}") from exc
    unexpected = list(result.unexpected_keys)
    missing = sorted(k for k in result.missing_keys if k in expected)
    if unexpected or missing:
        raise ValueError(f"{mismatch}: missing {missing[:3]}, unexpected {unexpected[:3]}")


def load_checkpoint_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """A checkpoint's weights into ``model``: its adapters for a peft model, else every
    weight of ``model.safetensors`` (strict)."""
    if is_lora(model):
        load_adapter_weights(model, ckpt)
        return
    if (ckpt / ADAPTER_WEIGHTS).is_file() and not (ckpt / "model.safetensors").is_file():
        raise ValueError(
            f"{ckpt} holds LoRA adapters ({ADAPTER_WEIGHTS}); set model.lora.enabled: true "
            "(with the run's rank and target_modules) to load it"
        )
    from safetensors.torch import load_model

    load_model(model, str(ckpt / "model.safetensors"))
