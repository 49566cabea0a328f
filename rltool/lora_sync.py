"""What a weight sync sends to an engine that holds its own copy: adapters or merged weights.

:func:`rollout_weights` is the one place that decides. An engine that loads LoRA adapters
(``RolloutEngine.takes_adapters``: vLLM started with ``enable_lora``, in process or as a
server) gets an :class:`AdapterPayload`, the policy's lora_A/lora_B tensors under peft's
save names plus the adapter config (rank, alpha, target modules), written as peft's
``adapter_model.safetensors`` + ``adapter_config.json`` (:func:`write_adapter`) and
loaded as a LoRA adapter; every other engine, and a policy whose adapters that format
cannot describe (:func:`adapter_payload` says why), gets ``rollout_state_dict``, the
merged full weights. :func:`weights_nbytes` is what a sync moves
(``rollout/weight_sync_bytes``). Design: docs/lora.md#what-the-rollout-engine-sees
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rltool.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    engine_model,
    has_lora_layers,
    lora_layers,
    rollout_state_dict,
)

log = logging.getLogger(__name__)
PEFT_PREFIX = "base_model.model."  # peft's save names: base_model.model.<module>.lora_A.weight


@dataclass(frozen=True, slots=True)
class AdapterPayload:
    """One LoRA adapter as peft saves it (and vLLM's LoRA loader reads it)."""

    tensors: dict[str, torch.Tensor]  # <PEFT_PREFIX><module>.lora_A.weight [r, in], lora_B [out, r]
    config: dict[str, Any]  # adapter_config.json: peft_type, r, lora_alpha, target_modules, ...

    @property
    def rank(self) -> int:
        return int(self.config["r"])


RolloutWeights = Mapping[str, torch.Tensor] | AdapterPayload


@torch.no_grad()
def adapter_payload(model: torch.nn.Module) -> AdapterPayload | str:
    """The active adapter of ``model`` (a peft model, or the base model a shared engine
    holds) as an :class:`AdapterPayload`; or, where rank + alpha on linear layers cannot
    describe it, the reason (a string). Tensors are detached CPU copies."""
    base = engine_model(model)
    layers = list(lora_layers(base))
    if not layers:
        return "the model has no LoRA layers"
    tensors: dict[str, torch.Tensor] = {}
    ranks, alphas, targets, scalings = set(), set(), set(), set()
    for name, layer in layers:
        active = list(layer.active_adapters)
        if layer.disable_adapters or layer.merged:
            return f"{name}: adapters disabled or merged into the weight"
        if len(active) != 1:
            return f"{name}: {len(active)} active adapters (one is sent)"
        (adapter,) = active
        if not isinstance(layer, torch.nn.Module) or adapter not in layer.lora_A:
            return f"{name}: a LoRA layer that is not linear (e.g. an embedding)"
        if layer.use_dora.get(adapter, False) or getattr(layer, "lora_bias", {}).get(adapter):
            return f"{name}: DoRA or a LoRA bias (vLLM loads plain LoRA)"
        ranks.add(layer.r[adapter])
        alphas.add(layer.lora_alpha[adapter])
        scalings.add(layer.scaling[adapter])
        targets.add(name.rsplit(".", 1)[-1])
        for part in ("lora_A", "lora_B"):
            weight = getattr(layer, part)[adapter].weight  # A: [r, in], B: [out, r]
            tensors[f"{PEFT_PREFIX}{name}.{part}.weight"] = weight.detach().to("cpu").clone()
    if len(ranks) != 1 or len(alphas) != 1 or len(scalings) != 1:
        return f"layers differ in rank {sorted(ranks)} or alpha {sorted(alphas)}"
    (r,), (alpha,), (scaling,) = ranks, alphas, scalings
    rslora = abs(scaling - alpha / r**0.5) < 1e-9 * scaling and r != 1
    if not rslora and abs(scaling - alpha / r) > 1e-9 * scaling:
        return f"scale {scaling} is neither alpha / r nor alpha / sqrt(r)"
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(r),
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "use_rslora": bool(rslora),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    return AdapterPayload(tensors, config)


def rollout_weights(model: torch.nn.Module, takes_adapters: bool) -> RolloutWeights:
    """What an engine that holds its own copy loads: the adapter where it ``takes_adapters``
    and the model has one it can describe, else the merged state dict
    (``rollout_state_dict``: the weights as they are for a model without adapters)."""
    if takes_adapters and has_lora_layers(model):  # a full-model run has nothing to warn of
        payload = adapter_payload(model)
        if isinstance(payload, AdapterPayload):
            return payload
        log.warning("LoRA sync: sending merged weights instead of adapters: %s", payload)
    return rollout_state_dict(model)


def weights_nbytes(weights: RolloutWeights) -> int:
    """Bytes of the tensors a sync hands over; a tensor that is another's alias (a tied
    LM head) is counted once, as it is written once."""
    tensors = weights.tensors if isinstance(weights, AdapterPayload) else weights
    seen: set[tuple] = set()
    total = 0
    for t in tensors.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def write_adapter(payload: AdapterPayload, folder: Path) -> Path:
    """``folder`` (new) holding peft's two files; written under a temporary name then
    renamed, so a reader never sees half an adapter."""
    from safetensors.torch import save_file

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tensors = {k: v.contiguous() for k, v in payload.tensors.items()}
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS))
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(payload.config, indent=2))
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
