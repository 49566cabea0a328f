"""FSDP2 data parallelism for the trainer: the process group, the sharded model, the
step's rows split across ranks, metric sums reduced, full weights one parameter at a time.

Every function here is SPMD: each rank calls it in the same order with the same arguments
(the rows of a step are known to every rank). Design: docs/distributed.md
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rltool.config.schema import DistributedConfig

# the other ranks wait in a collective while the leader generates and evaluates
_TIMEOUT = timedelta(hours=2)


@dataclass(slots=True)
class Shard:
    """This process's place in the data-parallel group."""

    rank: int
    world_size: int
    device: torch.device  # where this rank computes (cuda:LOCAL_RANK or cpu)
    objects: Any  # the process group Python objects travel on (gloo, also under NCCL)

    @property
    def leader(self) -> bool:
        return self.rank == 0


def launched_world_size() -> int:
    """WORLD_SIZE that torchrun (or our own relaunch) gave this process; 1 outside one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_distributed(cfg: DistributedConfig) -> None:
    """What this machine lacks for ``distributed.*`` (the names were checked when the
    recipe loaded); nothing is started here."""
    if cfg.mixed_precision == "bf16" and not torch.cuda.is_available():
        raise ValueError(
            "distributed.mixed_precision: bf16 needs CUDA (no GPU here); set it to none"
        )


def init_shard(cfg: DistributedConfig) -> Shard | None:
    """Join the process group torchrun describes in the environment (NCCL on CUDA, gloo
    on the CPU); None when this process runs alone."""
    if launched_world_size() <= 1:
        return None
    check_distributed(cfg)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=_TIMEOUT)
    objects = dist.new_group(backend="gloo", timeout=_TIMEOUT) if cuda else dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return Shard(dist.get_rank(), dist.get_world_size(), device, objects)


def ready(shard: Shard | None) -> None:
    """Every rank waits here for the others (e.g. until the leader has built a model)."""
    if shard is not None:
        dist.barrier(group=shard.objects)


def close_shard(shard: Shard | None) -> None:
    if shard is not None and dist.is_initialized():
        dist.destroy_process_group()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: no model.layers to shard; distributed training needs a "
            "Hugging Face decoder-only causal LM"
        )
    return list(layers)


def shard_model(model: torch.nn.Module, cfg: DistributedConfig) -> torch.nn.Module:
    """``fully_shard`` on each decoder layer, then on the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy()
    if cfg.mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = {
        "mp_policy": mp,
        "offload_policy": CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
        "reshard_after_forward": cfg.strategy == "full_shard",
    }
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def rank_slots(buckets: list[list[int]], shard: Shard) -> list[tuple[int, bool]]:
    """This rank's rows of one mini-batch as (row index, live); ``buckets`` holds a
    token-balanced split of the mini-batch's rows into ``world_size`` lists. Every rank gets
    the same number of slots (FSDP's collectives run once per forward on every rank): short
    lists are padded with a not-live row (mask all off: zero loss, zero gradient)."""
    slots = max((len(b) for b in buckets), default=0)
    mine = buckets[shard.rank] if shard.rank < len(buckets) else []
    filler = next(b[0] for b in buckets if b)
    return [(i, True) for i in mine] + [(filler, False)] * (slots - len(mine))


def reduce_sums(sums: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """Metric sums added over the ranks (every key any rank has; absent = 0)."""
    keys: list[list[str]] = [[] for _ in range(shard.world_size)]
    dist.all_gather_object(keys, sorted(sums), group=shard.objects)
    names = sorted({k for ks in keys for k in ks})
    zero = torch.zeros((), device=shard.device)
    stacked = torch.stack([sums[k].to(shard.device) if k in sums else zero for k in names])  # [K]
    dist.all_reduce(stacked)
    return dict(zip(names, stacked, strict=True))


def gather_objects(obj: Any, shard: Shard) -> list[Any]:
    """Every rank's ``obj`` (picklable, on the CPU), in rank order."""
    out: list[Any] = [None] * shard.world_size
    dist.all_gather_object(out, obj, group=shard.objects)
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or gradient norm."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of each parameter, gathered one at a time (collective)."""
    for name, param in model.named_parameters():
        yield name, full_tensor(param.detach())


@torch.no_grad()
def copy_full_weights(model: torch.nn.Module, target: torch.nn.Module | None) -> None:
    """Gather the sharded ``model`` parameter by parameter into ``target`` (a full copy,
    on the leader); ranks without a target take part in the gathers and drop them."""
    params = dict(target.named_parameters()) if target is not None else {}
    for name, full in full_parameters(model):
        if target is not None:
            params[name].copy_(full)


def announce(shard: Shard, message: Any) -> None:
    """The leader sends ``message`` to every other rank (see ``receive``)."""
    dist.broadcast_object_list([message], src=0, group=shard.objects)


def receive(shard: Shard) -> Any:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=shard.objects)
    return box[0]
