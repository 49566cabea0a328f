"""The vLLM worker extension (``worker_extension_cls``) that rltool's vLLM engines load.

Its methods run inside vLLM's workers, reached with ``LLM.collective_rpc(name, args=...)``
(or the server's ``/collective_rpc``): weights in place from a safetensors file, and
logprobs in rltool's convention. Imported by vLLM in the worker process, never by the
main environment. Design: docs/engines.md#the-vllm-engine
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from safetensors.torch import load_file

EXTENSION = "rltool.engines.vllm_worker.RltoolWorkerExtension"  # worker_extension_cls


def _tempered_logprobs(forward: Callable) -> Callable:
    """``TopKTopPSampler.forward`` returning ``log_softmax(logits / t)`` over the whole
    vocabulary, taken before top-k/top-p touch the (already tempered) logits in place."""

    def wrapped(logits: torch.Tensor, generators, k, p):  # logits: [B, V], divided by t
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # [B, V]
        sampled, _ = forward(logits, generators, k, p)
        return sampled, logprobs

    wrapped.rltool_tempered = True
    return wrapped


class RltoolWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner`` etc.)."""

    rltool_model_step: int = 0

    def rltool_tempered_logprobs(self) -> bool:
        """Make the sampler return rltool's logprobs (needs ``logprobs_mode=
        "processed_logprobs"``): the tempered distribution before top-k/top-p, as the
        trainer recomputes it. Greedy rows already get ``log_softmax(logits)``."""
        sampler = self.model_runner.sampler.topk_topp_sampler
        if not getattr(sampler.forward, "rltool_tempered", False):
            sampler.forward = _tempered_logprobs(sampler.forward)
        return True

    def rltool_load_weights(self, path: str, model_step: int) -> int:
        """Reload every weight in place from the safetensors file at ``path`` (names as in
        the Hugging Face checkpoint) and stamp ``model_step``; returns the step. The caller
        resets the prefix cache afterwards."""
        state_dict = load_file(path, device="cpu")
        self.model_runner.reload_weights(weights_iterator=iter(state_dict.items()))
        _repack_cpu_gemm(self.model_runner.get_model())
        self.rltool_model_step = model_step
        return model_step

    def rltool_model_step_now(self) -> int:
        """The step of the weights this worker holds."""
        return self.rltool_model_step


def _repack_cpu_gemm(model: torch.nn.Module) -> None:
    """The CPU backend keeps a packed copy of some linear weights (``cpu_linear``: the
    embedding and a tied LM head keep their weight too); a reload leaves those copies
    stale, so rebuild them from the reloaded weights. No-op on other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
