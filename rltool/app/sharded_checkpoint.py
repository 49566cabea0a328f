"""Checkpoints of an FSDP2 run: model and optimizer as ``torch.distributed.checkpoint``
shards, a full Hugging Face export, and the restore of any checkpoint (sharded or
single-process) on any number of processes.

A checkpoint of a run on several processes::

    step_000010/sharded/          DCP: {"model", "optim"}, one file per rank + .metadata
    step_000010/model.safetensors, config.json, tokenizer   the full policy (rank 0 writes)
    step_000010/trainer_state.pt  scheduler, RNG, producer, history; optimizer = SHARDED
    step_000010/manifest.json     written last, as for one process

Design: docs/distributed.md#checkpoints
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rltool.app.checkpoint import load_trainer_state
from rltool.lora import load_checkpoint_weights
from rltool.training.sharding import Shard

SHARDED_DIR = "sharded"
SHARDED = {"format": "dcp", "dir": SHARDED_DIR}  # TrainerState.optimizer of a sharded save
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def is_sharded(ckpt: Path) -> bool:
    return (ckpt / SHARDED_DIR / ".metadata").is_file()


def write_sharded(directory: Path, model: Any, optimizer: Any, shard: Shard | None) -> None:
    """Collective: every rank writes its shards of model and optimizer under
    ``directory/sharded``; then the full weights are gathered (rank 0 keeps them) and
    written as a Hugging Face checkpoint beside them. ``directory`` exists already."""
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    dcp.save(state, checkpoint_id=str(directory / SHARDED_DIR))
    export_full(directory, model, shard)


def export_full(directory: Path, model: Any, shard: Shard | None) -> None:
    """Collective: the whole policy as ``model.safetensors`` + ``config.json`` (rank 0),
    loadable by ``model.path`` like any Hugging Face checkpoint."""
    full = get_model_state_dict(model, options=_FULL)  # {} on every rank but 0
    if shard is None or shard.leader:
        model.save_pretrained(directory, state_dict=full, safe_serialization=True)


def restore_updater(
    ckpt: Path, model: Any, optimizer: Any, scheduler: Any, shard: Shard | None
) -> None:
    """Weights, optimizer and schedule of checkpoint ``ckpt`` into this process's updater,
    whichever number of processes saved it (collective when ``shard`` is set)."""
    state = load_trainer_state(ckpt)
    if is_sharded(ckpt):
        target = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
        }
        dcp.load(target, checkpoint_id=str(ckpt / SHARDED_DIR))
        set_model_state_dict(model, target["model"])
        set_optimizer_state_dict(model, optimizer, target["optim"])
    else:
        _restore_single(ckpt, model, optimizer, state.optimizer, shard)
    scheduler.load_state_dict(state.scheduler)


def _restore_single(
    ckpt: Path, model: Any, optimizer: Any, optim_state: dict, shard: Shard | None
) -> None:
    """A one-process checkpoint (``model.safetensors`` and a plain optimizer state)."""
    from safetensors.torch import load_file

    if shard is None:  # adapters for a LoRA model, else every weight (strict)
        load_checkpoint_weights(model, ckpt)
        optimizer.load_state_dict(optim_state)
        return
    full = load_file(str(ckpt / "model.safetensors"))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n in names if n not in full]
    if missing:
        raise ValueError(f"{ckpt}/model.safetensors has no weight for {missing[:3]}")
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, {n: full[n] for n in names}, options=options)
    set_optimizer_state_dict(model, optimizer, _by_name(optim_state, names), options=options)
    dist.barrier()


def load_full_moments(model: Any, optimizer: Any, path: Path) -> None:
    """Warm-start moments (``optimizer.pt``, saved by one process) into a sharded
    optimizer; the current hyperparameters (lr, betas, ...) stay."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no optimizer state to warm-start from; set "
            "optimizer.init_from_checkpoint=false"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    full = _by_name(saved, names)
    current = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    full["param_groups"] = [
        {**c, "params": g["params"]} for c, g in zip(current, full["param_groups"], strict=True)
    ]
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, full, options=options)


def _by_name(optim_state: dict, names: list[str]) -> dict:
    """A plain optimizer state (parameters by index, in ``build_optimizer``'s order) keyed
    by parameter name, the form ``set_optimizer_state_dict`` takes for a full state."""
    ids = [i for g in optim_state["param_groups"] for i in g["params"]]
    if len(ids) != len(names):
        raise ValueError(
            f"the checkpoint's optimizer holds {len(ids)} parameters, the model has "
            f"{len(names)} trainable ones"
        )
    to_name = dict(zip(ids, names, strict=True))
    groups = [
        {**g, "params": [to_name[i] for i in g["params"]]} for g in optim_state["param_groups"]
    ]
    state = {to_name[i]: s for i, s in optim_state["state"].items()}
    return {"state": state, "param_groups": groups}
