"""``VLLMEngine`` in the main environment, on a stand-in for vLLM's ``LLM`` backed by an HF
engine: the shared base (chunked.py) as the vLLM engine drives it (a group's prompt once
with ``n``, pause points, stop strings across them, step stamps) and the weights it sends
(a LoRA policy merged under the base names), and, started with ``enable_lora``, the
adapters it loads instead (peft reads them). The real vLLM: tests/vllm_env."""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import LoraConfig, SamplingConfig
from rltool.engines import vllm as vllm_engine
from rltool.engines.hf import HFEngine
from rltool.engines.vllm import VLLMEngine
from rltool.lora import apply_lora, engine_model, merged_copy

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6)


class FakeLLM:
    """What ``VLLMEngine`` calls on vLLM's ``LLM``, answered by an ``HFEngine``."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any):
        self.hf = HFEngine(model, tokenizer, share_prefill=False)
        self.calls: list[tuple[int, int, int]] = []  # (n, max_tokens, prompts) per generate
        self.loaded: list[dict[str, torch.Tensor]] = []  # each weights file, as read
        self.llm_engine = SimpleNamespace()  # no engine core to stop

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        if method == "rltool_tempered_logprobs":
            return [True]
        assert method == "rltool_load_weights"
        path, step = args
        state = load_file(path)
        self.loaded.append(state)
        missing, unexpected = self.hf.model.load_state_dict(state, strict=False)
        assert (missing, unexpected) == (["lm_head.weight"], [])  # tied: sent as the embedding
        return [step]

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(
        self, prompts: list[dict], params: Any, use_tqdm: bool, lora_request: Any = None
    ) -> list[Any]:
        assert lora_request is None  # the stand-in serves its model's weights only
        self.calls.append((params.n, params.max_tokens, len(prompts)))
        sampling = SamplingConfig(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_new_tokens=params.max_tokens,
            stop=params.stop or [],
        )
        outs = []
        for p in prompts:
            gens = self.hf.generate([p["prompt_token_ids"]] * params.n, sampling)
            outputs = [
                SimpleNamespace(
                    token_ids=g.token_ids,
                    logprobs=[
                        {t: SimpleNamespace(logprob=x)}
                        for t, x in zip(g.token_ids, g.logprobs, strict=True)
                    ],
                    finish_reason=g.finish_reason,
                )
                for g in gens
            ]
            outs.append(SimpleNamespace(outputs=outputs))
        return outs


@pytest.fixture(autouse=True)
def no_vllm(monkeypatch):
    fake = SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: fake)


@pytest.fixture(scope="module")
def model(tokenizer) -> Qwen2ForCausalLM:
    """A tiny random model whose greedy text varies (weights drawn wider than the init's)."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 1, 2, 64)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


def _prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(f"Q: what is {i} plus {2 * i}? A:") for i in range(n)]


def test_groups_go_once_with_n_and_chunks_change_nothing(model, tokenizer):
    prompts = [p for p in _prompts(tokenizer, 3) for _ in range(2)]  # 3 groups of 2
    llm = FakeLLM(copy.deepcopy(model), tokenizer)
    whole = VLLMEngine(llm, tokenizer).generate(prompts, GREEDY)
    want = HFEngine(model, tokenizer).generate(prompts, GREEDY)
    assert [g.token_ids for g in whole] == [w.token_ids for w in want]
    assert [g.finish_reason for g in whole] == [w.finish_reason for w in want]
    for g, w in zip(whole, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert llm.calls == [(2, 6, 3)]  # one call: each distinct prompt once, n = 2
    llm.calls.clear()
    chunked = VLLMEngine(llm, tokenizer, chunk_tokens=4).generate(prompts, GREEDY)
    assert [g.token_ids for g in chunked] == [w.token_ids for w in want]
    assert llm.calls[0] == (2, 4, 3)  # then the rest: 2 tokens per unfinished context
    assert {(n, k) for n, k, _ in llm.calls[1:]} <= {(1, 2), (2, 2)}


def test_a_stop_string_across_pause_points_ends_the_row(model, tokenizer):
    prompts = _prompts(tokenizer, 4)
    free = HFEngine(model, tokenizer).generate(prompts, SamplingConfig(0.0, max_new_tokens=8))
    stop = free[0].text[2:5]  # a stop string the greedy text reaches
    assert stop.strip()
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8, stop=[stop])
    want = HFEngine(model, tokenizer).generate(prompts, sampling)
    engine = VLLMEngine(FakeLLM(copy.deepcopy(model), tokenizer), tokenizer, chunk_tokens=1)
    got = engine.generate(prompts, sampling)
    assert [(g.token_ids, g.finish_reason) for g in got] == [
        (w.token_ids, w.finish_reason) for w in want
    ]
    assert got[0].finish_reason == "stop"


@pytest.mark.parametrize("held", ["base model (sync in process)", "peft model"])
def test_sync_weights_of_a_lora_policy_sends_merged_base_weights(model, tokenizer, held):
    """What ``rltool_load_weights`` reads in vLLM's workers: the base model's names (no
    lora_A, no base_layer) and W + scale * B @ A, whichever object the engine holds."""
    lora = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    policy = apply_lora(copy.deepcopy(model), lora)
    torch.manual_seed(3)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # B != 0: the adapters change the weights
    llm = FakeLLM(copy.deepcopy(model), tokenizer)
    held_model = engine_model(policy) if held.startswith("base") else policy
    engine = VLLMEngine(llm, tokenizer, model=held_model)
    engine.sync_weights(1)
    (received,) = llm.loaded
    merged = merged_copy(policy).eval()
    expected = merged.state_dict()
    assert set(received) == set(model.state_dict()) - {"lm_head.weight"}  # tied head dropped
    for name, value in received.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(received[q], model.state_dict()[q])  # the adapters are in
    prompts = _prompts(tokenizer, 3)
    got = engine.generate(prompts, GREEDY)
    want = HFEngine(merged, tokenizer).generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(g.model_steps == [1] * len(g.token_ids) for g in got)
    engine.shutdown()


class FakeLoraLLM(FakeLLM):
    """``FakeLLM`` started with ``enable_lora``: ``add_lora`` reads the adapter folder with
    peft (what vLLM's loader reads), generations that name it sample base + adapter."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any):
        super().__init__(model, tokenizer)
        self.adapters: dict[int, HFEngine] = {}
        self.removed: list[int] = []
        self.llm_engine = SimpleNamespace(
            add_lora=self._add, remove_lora=self._remove, list_loras=lambda: set(self.adapters)
        )

    def _add(self, request: Any) -> bool:
        from peft import PeftModel

        base = copy.deepcopy(self.hf.model)
        merged = PeftModel.from_pretrained(base, request.lora_path).merge_and_unload()
        self.adapters[request.lora_int_id] = HFEngine(merged.eval(), self.hf.tokenizer)
        return True

    def _remove(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.adapters.pop(lora_id) is not None

    def generate(self, prompts, params, use_tqdm, lora_request=None):
        if lora_request is None:
            return super().generate(prompts, params, use_tqdm)
        hf, self.hf = self.hf, self.adapters[lora_request.lora_int_id]
        try:
            return super().generate(prompts, params, use_tqdm)
        finally:
            self.hf = hf


def test_a_lora_engine_loads_adapters_under_a_new_id_each_sync(model, tokenizer, monkeypatch):
    pytest.importorskip("peft")
    lora_module = SimpleNamespace(LoRARequest=_lora_request)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora_module)
    policy = apply_lora(copy.deepcopy(model), LoraConfig(rank=4, alpha=8))
    llm = FakeLoraLLM(copy.deepcopy(model), tokenizer)
    engine = VLLMEngine(llm, tokenizer, model=engine_model(policy), max_lora_rank=8)
    prompts = _prompts(tokenizer, 3)
    folders = []
    for step, seed in ((1, 3), (2, 4)):
        torch.manual_seed(seed)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)  # B != 0: the adapters change the outputs
        engine.sync_weights(step)
        folders.append(engine._lora_path)
        got = engine.generate(prompts, GREEDY)
        want = HFEngine(merged_copy(policy).eval(), tokenizer).generate(prompts, GREEDY)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert all(set(g.model_steps) == {step} for g in got)
    assert llm.loaded == []  # no full weights were sent
    assert (set(llm.adapters), llm.removed) == ({2}, [1])  # a new id, the old one removed
    assert not folders[0].exists() and folders[1].is_dir()
    big = apply_lora(copy.deepcopy(model), LoraConfig(rank=16, alpha=8))
    engine.model = engine_model(big)
    with pytest.raises(ValueError, match=r"rank 16 .* max_lora_rank 8"):
        engine.sync_weights(3)
    engine.shutdown()


def _lora_request(name: str, lora_int_id: int, lora_path: str) -> Any:
    return SimpleNamespace(lora_name=name, lora_int_id=lora_int_id, lora_path=lora_path)
