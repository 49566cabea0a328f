"""Mixture-of-experts routers of a Hugging Face model: find them, record their choices, replay
recorded choices.

Shape legend: B = rows of a forward, S = positions per row, L = MoE layers (routers, in
layer order), k = experts per token, E = experts, H = hidden size.
Design: docs/routing-replay.md
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rltool.rollout.routing import NOT_ROUTED


def _softmax_topk_norm(logits: torch.Tensor, idx: torch.Tensor, router: torch.nn.Module):
    """Qwen3MoeTopKRouter: softmax in float32, the chosen probabilities, renormalised when
    ``norm_topk_prob``, cast back to the logits' dtype."""
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)  # [BS, E]
    top = probs.gather(-1, idx)  # [BS, k]
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _softmax_topk_always_norm(logits: torch.Tensor, idx: torch.Tensor, router: torch.nn.Module):
    """MixtralTopKRouter: softmax of the float32 logits, the chosen ones renormalised."""
    probs = torch.softmax(logits.float(), dim=-1)  # [BS, E]
    top = probs.gather(-1, idx)  # [BS, k]
    return top / top.sum(dim=-1, keepdim=True)


# router class name -> the gate weights of given experts, computed as that router does
GATES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.nn.Module], torch.Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_topk_norm,
    "MixtralTopKRouter": _softmax_topk_always_norm,
}
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True, slots=True)
class Routers:
    """The routers of a model, in layer order."""

    modules: list[torch.nn.Module]  # [L]
    top_k: int
    num_experts: int

    @property
    def layers(self) -> int:
        return len(self.modules)


def find_routers(model: torch.nn.Module, required: str | None = None) -> Routers | None:
    """The model's top-k routers, or None (a dense model, or routers rltool does not know).
    ``required``: the recipe key that needs them; then None is a ValueError instead."""
    found = [m for m in model.modules() if type(m).__name__ in GATES]
    if found:
        return Routers(found, int(found[0].top_k), int(found[0].num_experts))
    if required is None:
        return None
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, key, 0) for key in _EXPERT_KEYS):
        known = ", ".join(n.removesuffix("TopKRouter") for n in GATES)
        why = f"its mixture-of-experts routers are not supported (known: {known})"
    else:
        why = "it has no mixture-of-experts routers"
    raise ValueError(f"{required} is true but the model is {type(model).__name__}: {why}")


@contextmanager
def _hooked(
    model: torch.nn.Module,
    routers: Routers,
    on_route: Callable[[int, tuple, tuple[int, int]], tuple | None],
) -> Iterator[None]:
    """Calls ``on_route(layer, router output, (B, S))`` after every router call of every
    forward of ``model`` (B, S: the forward's input_ids shape); a returned tuple replaces the
    router's output."""
    shape: list[tuple[int, int]] = []

    def before_forward(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("routing capture and replay need input_ids (not inputs_embeds)")
        shape[:] = [tuple(ids.shape)]

    def router_hook(layer: int):
        return lambda _module, _inputs, output: on_route(layer, output, shape[0])

    handles = [model.register_forward_pre_hook(before_forward, with_kwargs=True)]
    handles += [r.register_forward_hook(router_hook(i)) for i, r in enumerate(routers.modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def recording(model: torch.nn.Module, routers: Routers) -> Iterator[list[torch.Tensor]]:
    """Yields a list that gets, per forward of ``model``, the chosen experts [B, S, L, k]
    (on the model's device: no sync per decode step), in call order."""
    out: list[torch.Tensor] = []
    layers: list[torch.Tensor] = []

    def on_route(layer: int, output: tuple, bs: tuple[int, int]) -> None:
        layers.append(output[2].detach().view(*bs, -1))  # [B, S, k]
        if layer == routers.layers - 1:
            out.append(torch.stack(layers, dim=2))  # [B, S, L, k]
            layers.clear()

    with _hooked(model, routers, on_route):
        yield out


@dataclass(slots=True)
class Replayed:
    """What one replayed forward saw: per position, whether the router's own choice differed
    from the recorded one at any layer, over the positions that carry a recording."""

    differs: torch.Tensor  # [S] bool (a one-row forward)
    recorded: torch.Tensor  # [S] bool, the position's row is not NOT_ROUTED


@contextmanager
def replaying(
    model: torch.nn.Module, routers: Routers, experts: torch.Tensor, replay: bool = True
) -> Iterator[Replayed]:
    """Inside, a one-row forward of ``model`` over S positions routes each position to
    ``experts`` [S, L, k] (rows of NOT_ROUTED keep the router's own choice); the gate weights
    are recomputed from the current router logits over those experts, so the router gets
    gradients. ``replay=False`` only compares. Yields the comparison, filled by the forward."""
    s, layers, k = experts.shape
    if layers != routers.layers or k != routers.top_k:
        raise ValueError(
            f"routed_experts has {layers} layers x {k} experts per token, the model has "
            f"{routers.layers} MoE layers x top-{routers.top_k}: the rollouts come from "
            "another model"
        )
    seen = Replayed(torch.zeros(s, dtype=torch.bool), experts[:, 0, 0] != NOT_ROUTED)

    def on_route(layer: int, output: tuple, bs: tuple[int, int]) -> tuple | None:
        logits, _, own = output  # [S, E], [S, k], [S, k]
        if bs != (1, s):
            raise ValueError(f"routing replay of {s} positions got a forward of shape {bs}")
        want = experts[:, layer].to(own.device)  # [S, k]
        keep = (want == NOT_ROUTED).any(-1, keepdim=True)  # [S, 1]
        want = torch.where(keep, own, want)  # [S, k]
        same = (own.sort(-1).values == want.sort(-1).values).all(-1)  # [S]
        seen.differs |= ~same.cpu()
        if not replay:
            return None
        gates = GATES[type(routers.modules[layer]).__name__]
        return logits, gates(logits, want, routers.modules[layer]), want

    with _hooked(model, routers, on_route):
        yield seen
