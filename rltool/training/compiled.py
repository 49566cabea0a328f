"""The decoder layers under ``torch.compile`` for the train step's forwards only
(``trainer.compile: layers``).

Each decoder layer (transformers' ``GradientCheckpointingLayer``) gets a compiled twin of
its call (inductor, dynamic shapes: every pack has its own length), swapped in while the
updater runs and swapped out afterwards, so that the rollout engine sharing the model
object generates with the eager layers (a KV cache would recompile). The attention call
stays eager (``segment_attention`` is excluded from compilation: its groups differ per
row); what compiles is the rest of a layer: norms, projections, rotary, SiLU, residuals,
forward and backward fused. Eager is the reference: a test holds the compiled step's loss
and gradients to it. The first step pays the compile (tens of seconds on 2 cores), so on
the CPU demo it does not pay back (docs/foundations.md, Where a train step's time goes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from rltool.training.attention import excluded_from_compile

COMPILE_MODES = ("off", "layers")  # trainer.compile


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (also inside a LoRA wrapper), outermost first."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class CompiledLayers:
    """Compiled twins of ``model``'s decoder layers, active inside ``active()``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = decoder_layers(model)
        if not self.layers:
            raise ValueError(
                f"trainer.compile: layers: {type(model).__name__} has no transformers decoder "
                "layers (GradientCheckpointingLayer) to compile; set trainer.compile: off"
            )
        self._calls: list[Callable] = [
            torch.compile(layer._call_impl, dynamic=True) for layer in self.layers
        ]

    @contextmanager
    def active(self) -> Iterator[None]:
        for layer, call in zip(self.layers, self._calls, strict=True):
            layer._compiled_call_impl = call  # what nn.Module.__call__ runs when set
        try:
            with excluded_from_compile():
                yield
        finally:
            for layer in self.layers:
                layer._compiled_call_impl = None
