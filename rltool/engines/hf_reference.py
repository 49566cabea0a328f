"""The Hugging Face engine's reference path: one ``generate`` call over a batch of contexts
(``rollout.hf_decode: reference``, models the lean loop cannot run, and per-sample streams),
with the engine's stopping criteria (EOS and stop strings, pause points for new weights), its
shared prefill and routing capture, and logprobs from the raw logits at the sampling
temperature. The lean loops (hf_decode.py, hf_refill.py) are held to its tokens and logprobs.

Shape legend: B = sequences in a batch, P = padded context length,
T = generated steps, V = vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StopStringCriteria

from rltool.config.schema import SamplingConfig
from rltool.engines.hf_prefill import left_pad
from rltool.engines.hf_routing import rows_routing
from rltool.engines.hf_sampling import PerSampleSampler
from rltool.engines.hf_stopping import FinishRecorder, PauseForWeights
from rltool.moe import recording

if TYPE_CHECKING:  # hf.py imports this module
    from rltool.engines.hf import HFEngine


def _generation_config(
    sampling: SamplingConfig, eos: list[int], pad_id: int, greedy: bool = False
) -> GenerationConfig:
    """``greedy``: argmax whatever the temperature (a logits processor already sampled)."""
    # Every sampling knob is set explicitly: values left unset would be filled
    # from the checkpoint's generation_config.json (repetition penalty, top_k, ...).
    greedy = greedy or sampling.temperature == 0
    sampler = (
        {}
        if greedy
        else {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,  # 0 = off
            "min_p": 0.0,
            "typical_p": 1.0,
        }
    )
    return GenerationConfig(
        do_sample=not greedy,
        **sampler,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        num_beams=1,
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad_id,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )


def generate_rows(
    engine: HFEngine,
    contexts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_new: int,
    stop: StopStringCriteria | None,
    streams: Sequence[torch.Generator] | None = None,
) -> tuple[list[list[int]], list[list[float]], list[bool], list[Any]]:
    """``HFEngine._generate_rows`` on ``generate``: per row the new tokens, their logprobs,
    whether the row ended, and its experts (None when not recorded). ``streams``: each row
    samples from its own generator (a logits processor draws, ``generate`` runs greedy)."""
    device = engine.model.device
    ids, mask = left_pad(contexts, engine.pad_id)  # [B, P]
    recorder = FinishRecorder(
        ids.shape[1], torch.tensor(engine.eos_ids, device=device), stop, len(contexts)
    )
    criteria: list[StoppingCriteria] = [recorder]
    if engine.chunk_tokens is not None:
        pause = PauseForWeights(lambda: engine.weights_waiting, ids.shape[1], engine.chunk_tokens)
        criteria.append(pause)
    cfg = _generation_config(sampling, engine.eos_ids, engine.pad_id, streams is not None)
    cfg.max_new_tokens = max_new
    processors = LogitsProcessorList(
        [] if streams is None else [PerSampleSampler(sampling, streams)]
    )
    with (
        recording(engine.model, engine._routers)
        if engine._routers is not None
        else contextlib.nullcontext([]) as forwards
    ):
        cache = None if engine._prefill is None else engine._prefill.cache(contexts, mask)
        res = engine.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=cfg,
            stopping_criteria=criteria,
            logits_processor=processors,
            **({} if cache is None else {"cache": cache}),
        )
    new = res.sequences[:, ids.shape[1] :]  # [B, T]
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    logits = torch.stack(res.logits, dim=1).float()  # [B, T, V]
    logits /= temperature
    chosen = logits.gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B, T]
    logprobs = (chosen - logits.logsumexp(-1)).cpu()  # [B, T]
    new = new.cpu()
    finished = recorder.lengths > 0  # [B]
    lengths = torch.where(finished, recorder.lengths, new.shape[1]).tolist()  # [B]
    tokens = [new[row, :n].tolist() for row, n in enumerate(lengths)]
    lps = [logprobs[row, :n].tolist() for row, n in enumerate(lengths)]
    routing: list[Any] = [None] * len(contexts)
    if engine._routers is not None:
        routing = rows_routing(forwards, contexts, lengths, cache is not None)
    return tokens, lps, finished.tolist(), routing
