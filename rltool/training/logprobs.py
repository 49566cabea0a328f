"""Per-token logprobs (and entropy) of a packed row in one forward.

Shape legend: N = tokens in the packed row, V = vocabulary size.

The row holds several samples back to back with ``position_ids`` restarting at
0 per sample; the row's ``attention`` kernel (``rltool.training.attention``,
chosen at conversion) keeps them apart without an [N, N] mask, except eager
attention, whose scores are [N, N] anyway: transformers derives its mask from
the restarting positions (only with ``attention_mask=None`` and
``use_cache=False``, facts.md), and a ``SharedPack`` passes its explicit mask
(``attention_allowed``, also the reference the kernels are tested against).
``tests/training/test_logprobs.py`` locks this: packed == each sample alone.

logprob of target y at a position with logits z (already divided by the
sampling temperature, so the trainer scores the distribution the engine sampled
from): ``z[y] - logsumexp(z)``. That avoids a second [N, V] tensor from
``log_softmax``; only the row's logits themselves stay alive for the backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from rltool.models import model_device
from rltool.rollout.state import IGNORE_INDEX
from rltool.training.attention import (
    DENSE,
    FLASH_VARLEN,
    FLEX_BLOCK,
    NATIVE,
    SDPA_TREE,
    SEGMENTED,
    SEGMENTS_KWARG,
    flex_block_mask,
    no_mask,
    segments_from,
    segments_of,
)
from rltool.training.batch import Pack, SharedPack

_ENTROPY_CHUNK = 1024  # rows per chunk when entropy is only a metric (bounds the [N, V] copy)


def attention_allowed(tree_ids: torch.Tensor, branch_ids: torch.Tensor) -> torch.Tensor:
    """[N, N] bool, True where query q may attend to key k (causal, own tree, prefix or own
    branch)."""
    n = int(tree_ids.shape[0])
    pos = torch.arange(n, device=tree_ids.device)  # [N]
    causal = pos[None, :] <= pos[:, None]  # [N, N]
    same_tree = tree_ids[None, :] == tree_ids[:, None]  # [N, N]
    visible = (branch_ids[None, :] == 0) | (branch_ids[None, :] == branch_ids[:, None])  # [N, N]
    return causal & same_tree & visible


def check_attention(model: torch.nn.Module, packs: list[Pack]) -> None:
    """Raise ValueError when the model cannot run a kernel the packs were laid out for."""
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", None))
    cuda = model_device(model).type == "cuda"
    need = {
        **dict.fromkeys(SEGMENTED, ("model.attn_implementation sdpa", impl in ("sdpa", "eager"))),
        FLASH_VARLEN: ("model.attn_implementation flash_attention_*", impl.startswith("flash")),
        FLEX_BLOCK: ("a model on CUDA with sdpa or flex_attention (flex_attention has no "
                     "backward on the CPU)", cuda and impl in ("sdpa", "flex_attention")),
        DENSE: ("model.attn_implementation sdpa or eager", impl in ("sdpa", "eager")),
        NATIVE: ("", True),
    }  # fmt: skip
    for i, p in enumerate(packs):
        what, ok = need.get(p.attention, (f"one of {sorted(need)}", False))
        if not ok:
            raise ValueError(
                f"pack {i} was laid out for attention {p.attention!r}, which needs {what}; "
                "convert with the model's model.attn_implementation and model.device, or set "
                "trainer.prefix_sharing: false"
            )


def packed_logits(model: torch.nn.Module, pack: Pack) -> torch.Tensor:
    """Logits of one packed row under its ``attention`` kernel; never a cache."""
    device = model_device(model)
    mask, extra = None, {}
    shared = isinstance(pack, SharedPack) and pack.attention == SDPA_TREE
    merged = pack.merged if shared else None  # branches merged where alike: branch_merge.py
    if merged is not None:
        extra = {SEGMENTS_KWARG: segments_from(merged.pieces, len(merged.rep), device)}
    elif pack.attention in SEGMENTED:  # causal SDPA per sample / per prefix and branch
        extra = {SEGMENTS_KWARG: segments_of(pack, device)}
    elif pack.attention == FLASH_VARLEN:  # transformers' variable-length flash kernel
        cu = pack.cu_seq_lens.to(device=device, dtype=torch.int32)
        extra = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
        extra |= {"max_length_q": pack.max_seq_len, "max_length_k": pack.max_seq_len}
    elif pack.attention == FLEX_BLOCK and isinstance(pack, SharedPack):
        mask = flex_block_mask(pack, device)
    elif pack.attention == DENSE and isinstance(pack, SharedPack):  # eager: [N, N] anyway
        allowed = attention_allowed(pack.tree_ids.to(device), pack.branch_ids.to(device))
        mask = allowed[None, None]  # [1, 1, N, N]
    ids, positions = pack.input_ids, pack.position_ids  # [N] each
    if merged is not None:
        ids, positions = ids[merged.rep], positions[merged.rep]  # [M] each
    node_of = None if merged is None else merged.node_of.to(device)  # [N]
    with (
        no_mask() if SEGMENTS_KWARG in extra else nullcontext(),
        _head_reads(model, node_of) if node_of is not None else nullcontext(),
    ):
        out = model(
            input_ids=ids.to(device)[None],  # [1, N] (merged: [1, M])
            position_ids=positions.to(device)[None],  # [1, N]
            attention_mask=mask,
            use_cache=False,
            **extra,
        )
    logits = out.logits[0]  # [N, V]
    if node_of is not None and len(logits) != len(node_of):  # no head hook ran: [M, V]
        logits = logits.index_select(0, node_of)
    return logits


@contextmanager
def _head_reads(model: torch.nn.Module, node_of: torch.Tensor) -> Iterator[None]:
    """Inside: the LM head reads the merged positions' hidden states copied out to the row's
    positions ([1, M, h] -> [1, N, h]), so no [M, V] logits are made beside the [N, V] ones
    (a large vocabulary's peak). The backward sums the copies' gradients, which is exact."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        yield
        return
    handle = head.register_forward_pre_hook(
        lambda _m, args: (args[0].index_select(-2, node_of), *args[1:])
    )
    try:
        yield
    finally:
        handle.remove()


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, scaled logits): logprob of each target, 0 where the target is -100."""
    logits = logits.float()  # [N, V], no copy for a float32 model
    if temperature != 1.0:
        logits = logits / temperature  # [N, V]
    mask = targets != IGNORE_INDEX  # [N]
    safe = torch.where(mask, targets, torch.zeros_like(targets))  # [N]
    picked = logits.gather(-1, safe[:, None]).squeeze(-1)  # [N]
    logp = picked - torch.logsumexp(logits, dim=-1)  # [N]
    return torch.where(mask, logp, torch.zeros_like(logp)), logits


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) per row: logsumexp(z) - sum softmax(z) * z."""
    lse = torch.logsumexp(logits, dim=-1)  # [N]
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    return lse - (probs * logits).sum(-1)  # [N]


def _entropy_no_grad(logits: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        chunks = torch.split(logits.detach(), _ENTROPY_CHUNK)
        return torch.cat([entropy_from_logits(c) for c in chunks])  # [N]


def forward_logprobs(
    model: torch.nn.Module,
    pack: Pack,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [N], entropy [N] or None) of one packed row, on the model's device.

    Entropy is of the temperature-scaled distribution at every position (mask it
    yourself). ``entropy_grad=False`` computes it detached and in row chunks, for
    when it is only a metric.
    """
    targets = pack.targets.to(model_device(model))  # [N]
    logp, logits = token_logprobs(packed_logits(model, pack), targets, temperature)
    if not with_entropy:
        return logp, None
    use_grad = entropy_grad and torch.is_grad_enabled()
    entropy = entropy_from_logits(logits) if use_grad else _entropy_no_grad(logits)
    return logp, entropy
