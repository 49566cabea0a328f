"""Routing replay in the training forward: the rollout's MoE experts instead of the router's
top-k (``algorithm.routing_replay``), and the per-step mismatch metric.

Shape legend: N = positions of a packed row, L = MoE layers, K = experts per token.
Design: docs/routing-replay.md
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rltool.moe import Routers, find_routers, replaying
from rltool.training.batch import Pack


class RoutingReplay:
    """Wraps each forward of a train step over a pack that carries ``routed_experts``
    [N, L, K]: with ``replay`` those experts route every position (gates recomputed from the
    current router logits, so the router still learns); always, the first forward of each
    pack counts the positions whose router's own choice differs from the rollout's at any
    layer (``actor/routing_mismatch``)."""

    def __init__(self, policy: torch.nn.Module, routers: dict[int, Routers], replay: bool):
        self._policy = id(policy)  # the model whose forwards the metric counts
        self._routers = routers  # id(model) -> its routers
        self.replay = replay
        self._measured: set[int] = set()  # numbers of the packs counted this step
        self._differs = 0
        self._recorded = 0

    @classmethod
    def for_models(
        cls, model: torch.nn.Module, ref_model: torch.nn.Module | None, replay: bool
    ) -> RoutingReplay | None:
        """None for a dense policy without replay. Raises ValueError when ``replay`` is asked
        of a model without (supported) MoE routers."""
        policy = find_routers(model, "algorithm.routing_replay" if replay else None)
        if policy is None:
            return None
        routers = {id(model): policy}
        ref = find_routers(ref_model) if ref_model is not None else None
        if ref is not None:
            routers[id(ref_model)] = ref
        return cls(model, routers, replay)

    def start_step(self) -> None:
        self._measured.clear()
        self._differs = self._recorded = 0

    @contextmanager
    def forward(self, model: torch.nn.Module, pack: Pack, index: int) -> Iterator[None]:
        """Around one forward of ``model`` over ``pack`` (the step's pack number ``index``)."""
        routers = self._routers.get(id(model))
        if pack.routed_experts is None or routers is None:
            if self.replay and routers is not None:
                raise ValueError(
                    f"algorithm.routing_replay: pack {index} carries no routed_experts; the "
                    "rollouts must record them (rollout.record_routing: null or true, engine hf)"
                )
            yield
            return
        with replaying(model, routers, pack.routed_experts, self.replay) as seen:
            yield
        if id(model) == self._policy and index not in self._measured:
            self._measured.add(index)
            self._differs += int((seen.differs & seen.recorded).sum())
            self._recorded += int(seen.recorded.sum())

    def metrics(self) -> dict[str, float]:
        """``actor/routing_mismatch``: of the positions with recorded experts, the fraction
        whose router (given the layers below it, replayed or not) chose other experts."""
        if not self._recorded:
            return {}
        return {"actor/routing_mismatch": self._differs / self._recorded}
