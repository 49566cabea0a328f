"""The session server driven by the official ``openai`` client."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import openai
import pytest
from session_fakes import (
    ADD_TOOL,
    ANSWER_TEXT,
    CALL_TEXT,
    ScriptedEngine,
    logprobs_for,
    render_ids,
)

from rltool.config.schema import SamplingConfig
from rltool.engines.base import RolloutEngine
from rltool.rollout.contract import check_sample
from rltool.sessions import SessionServer, export
from rltool.training.advantages import session_clusters

try:
    import httpx2 as httpx  # the HTTP client under recent openai releases
except ImportError:
    import httpx

SYSTEM = {"role": "system", "content": "You add numbers with the add tool."}
USER = {"role": "user", "content": "What is 2 + 3?"}


def client_for(server: SessionServer, session_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url(session_id), api_key="unused", max_retries=0)


def as_template_message(m: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates take it: tool-call arguments as objects."""
    if not m.get("tool_calls"):
        return m
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]
    return {**m, "tool_calls": calls}


def assistant_mask(tok, messages: list[dict[str, Any]], tools) -> np.ndarray:
    """Supervised positions of the final render, from renders of its prefixes: an
    assistant message spans from the end of the render before it (generation
    prompt included) to its <|im_end|> (the newline after it is template glue)."""
    full = render_ids(tok, messages, gen=False, tools=tools)
    mask = np.zeros(len(full), dtype=bool)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(render_ids(tok, messages[:i], gen=True, tools=tools))
            end = len(render_ids(tok, messages[: i + 1], gen=False, tools=tools)) - 1
            mask[start:end] = True
    return mask


def test_tool_conversation_records_the_final_render_token_for_token(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL_TEXT, ANSWER_TEXT], model_step=3)
    with SessionServer(engine, tokenizer, SamplingConfig(max_new_tokens=64)) as server:
        server.open_session("ep0")
        client = client_for(server, "ep0")
        messages: list[Any] = [SYSTEM, USER]
        r1 = client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
        assert r1.choices[0].finish_reason == "tool_calls"
        call = r1.choices[0].message.tool_calls[0]
        assert call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
        messages.append(r1.choices[0].message)  # echoed as the client's own object
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
        engine.sync_weights(4)
        r2 = client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
        assert r2.choices[0].message.content == ANSWER_TEXT
        assert r2.choices[0].finish_reason == "stop"
        messages.append(r2.choices[0].message.model_dump(exclude_none=True))
        (state,) = export(server.close_session("ep0"), "g0", "calc", 1.0)

    final_msgs = [
        as_template_message(m if isinstance(m, dict) else m.model_dump(exclude_none=True))
        for m in messages
    ]
    final = render_ids(tokenizer, final_msgs, gen=False, tools=[ADD_TOOL])
    # recorded = the final render less the template's newline after the last <|im_end|>
    assert state.input_ids.tolist() == final[:-1]
    assert tokenizer.decode(final[-1:]) == "\n"
    mask = assistant_mask(tokenizer, final_msgs, [ADD_TOOL])[:-1]
    ids = np.asarray(state.input_ids)
    assert state.labels.tolist() == np.where(mask, ids, -100).tolist()
    spans = np.flatnonzero(np.diff(np.r_[0, mask.astype(int), 0]))  # start, end, start, end
    (s1, e1, s2, e2) = spans.tolist()
    assert tokenizer.decode(ids[s1:e1]) == CALL_TEXT + "<|im_end|>"
    assert tokenizer.decode(ids[s2:e2]) == ANSWER_TEXT + "<|im_end|>"
    # the prompt is the first render; turn 2 generated from the recorded ids
    assert state.prompt_ids.tolist() == render_ids(
        tokenizer, [SYSTEM, USER], gen=True, tools=[ADD_TOOL]
    )
    assert len(state.prompt_ids) == s1
    assert engine.calls[1][0] == [state.input_ids[:s2].tolist()]
    expected_lp = np.zeros(len(ids))
    expected_lp[s1:e1] = logprobs_for(e1 - s1, 0)
    expected_lp[s2:e2] = logprobs_for(e2 - s2, 1)
    assert state.logprobs.tolist() == expected_lp.tolist()
    # tool-result tokens take the version of the assistant turn before them
    assert state.response_model_steps.tolist() == [3] * (s2 - s1) + [4] * (e2 - s2)
    assert state.extra == {"tool_turns": 1, "num_turns": 2}
    assert r1.usage.prompt_tokens == s1 and r1.usage.completion_tokens == e1 - s1
    assert check_sample(state) == []


def test_history_rewrite_starts_a_new_segment_of_the_same_session(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL_TEXT, "5", "Done."])
    with SessionServer(engine, tokenizer) as server:
        server.open_session("ep1")
        client = client_for(server, "ep1")
        r1 = client.chat.completions.create(model="p", messages=[USER], tools=[ADD_TOOL])
        call = r1.choices[0].message.tool_calls[0]
        # the agent summarises the history instead of echoing it
        summary = [{"role": "user", "content": "2 + 3 was added with the tool: 5. Answer."}]
        r2 = client.chat.completions.create(model="p", messages=summary, tools=[ADD_TOOL])
        more = [*summary, {"role": "assistant", "content": r2.choices[0].message.content}]
        more.append({"role": "user", "content": "Thanks."})
        client.chat.completions.create(model="p", messages=more, tools=[ADD_TOOL])
        session = server.close_session("ep1")
    assert call.function.name == "add"
    seg0, seg1 = export(session, "g0", "calc", 0.0)
    first = render_ids(tokenizer, [USER], gen=True, tools=[ADD_TOOL])
    second = render_ids(tokenizer, summary, gen=True, tools=[ADD_TOOL])
    assert seg0.prompt_ids.tolist() == first
    assert seg0.input_ids[len(first) :].tolist() == [
        *tokenizer.encode(CALL_TEXT),
        tokenizer.eos_token_id,
    ]
    assert seg1.prompt_ids.tolist() == second
    assert engine.calls[1][0] == [second]  # generated from the new render, not the old tokens
    assert engine.calls[2][0][0][: len(second)] == second  # the third turn extends segment 1
    assert seg1.extra == {"tool_turns": 0, "num_turns": 2}
    assert (seg0.rollout_id, seg1.rollout_id) == ("ep1/seg0", "ep1/seg1")
    assert seg0.session_id == seg1.session_id == "ep1"
    assert check_sample(seg0) == [] and check_sample(seg1) == []
    assert session_clusters([[seg0, seg1]]).keys == [(0, "ep1")]


def test_non_canonical_sampled_tokens_keep_the_session_in_one_segment(tokenizer):
    by_char = [t for ch in ANSWER_TEXT for t in tokenizer.encode(ch)]
    assert by_char != tokenizer.encode(ANSWER_TEXT)  # the BPE merges some of these characters
    engine = ScriptedEngine(tokenizer, [by_char, "ok"])
    with SessionServer(engine, tokenizer) as server:
        server.open_session("ep2")
        client = client_for(server, "ep2")
        r1 = client.chat.completions.create(model="p", messages=[USER])
        messages = [USER, {"role": "assistant", "content": r1.choices[0].message.content}]
        messages.append({"role": "user", "content": "Sure?"})
        client.chat.completions.create(model="p", messages=messages)
        (state,) = export(server.close_session("ep2"), "g", "t", 1.0)
    p = len(state.prompt_ids)
    assert state.input_ids[p : p + len(by_char) + 1].tolist() == [*by_char, tokenizer.eos_token_id]
    final = [*messages, {"role": "assistant", "content": "ok"}]
    assert tokenizer.decode(state.input_ids) + "\n" == tokenizer.apply_chat_template(
        final, tokenize=False
    )
    assert state.extra == {"tool_turns": 0, "num_turns": 2}
    assert check_sample(state) == []


def test_unix_socket_serves_the_official_client(tokenizer, socket_dir):
    sock = socket_dir / "rl.sock"
    engine = ScriptedEngine(tokenizer, ["hello"])
    with SessionServer(engine, tokenizer, unix_socket=sock) as server:
        server.open_session("u1")
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)))
        client = openai.OpenAI(
            base_url="http://sandbox" + server.session_path("u1"),
            api_key="x",
            http_client=http,
            max_retries=0,
        )
        assert client.models.list().data[0].id == "rltool-policy"
        r = client.chat.completions.create(model="p", messages=[USER])
        assert r.choices[0].message.content == "hello"
    assert not sock.exists()


def test_sampling_recipe_knobs_win_unless_honored(tokenizer):
    recipe = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=32)
    for honor, temperature in ((False, 1.0), (True, 0.25)):
        engine = ScriptedEngine(tokenizer, ["a", "b"])
        with SessionServer(engine, tokenizer, recipe, honor_sampling=honor) as server:
            server.open_session("s")
            client = client_for(server, "s")
            kwargs = {"model": "p", "messages": [USER], "temperature": 0.25, "stop": ["\n\n"]}
            client.chat.completions.create(max_tokens=5, **kwargs)
            client.chat.completions.create(max_completion_tokens=100, **kwargs)
        (_, first), (_, second) = engine.calls
        assert (first.temperature, first.max_new_tokens, first.stop) == (temperature, 5, ["\n\n"])
        assert second.max_new_tokens == 32  # capped at the recipe's budget


class FailingEngine(ScriptedEngine):
    def generate(self, prompts, sampling):
        raise RuntimeError("CUDA out of memory")


def test_errors_reach_the_client_and_the_export(tokenizer):
    with SessionServer(FailingEngine(tokenizer, []), tokenizer) as server:
        server.open_session("bad")
        client = client_for(server, "bad")
        with pytest.raises(openai.NotFoundError, match="'nope' is not open"):
            nope = openai.OpenAI(base_url=f"{server.url}/s/nope/t/v1", api_key="-", max_retries=0)
            nope.chat.completions.create(model="p", messages=[USER])
        with pytest.raises(openai.BadRequestError, match="stream must be true or false"):
            client.chat.completions.create(model="p", messages=[USER], extra_body={"stream": 1})
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            client.chat.completions.create(model="p", messages=[USER], n=2)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            server.honor_sampling = True
            client.chat.completions.create(model="p", messages=[USER], temperature=-1)
        with pytest.raises(openai.InternalServerError, match="CUDA out of memory"):
            client.chat.completions.create(model="p", messages=[USER])
        with pytest.raises(openai.BadRequestError, match="failed earlier"):
            client.chat.completions.create(model="p", messages=[USER])
        session = server.close_session("bad")
    assert session.error is not None and "CUDA out of memory" in session.error
    with pytest.raises(ValueError, match="recorded no turn"):
        export(session, "g", "t", 0.0)


def test_sessions_are_opened_explicitly_with_safe_ids(tokenizer):
    server = SessionServer(ScriptedEngine(tokenizer, []), tokenizer)
    server.open_session("a")
    with pytest.raises(ValueError, match="already open"):
        server.open_session("a")
    with pytest.raises(ValueError, match="session id 'a/b'"):
        server.open_session("a/b")
    with pytest.raises(ValueError, match="not started"):
        server.base_url("a")


class Tap(RolloutEngine):
    """Wraps a real engine and keeps every Generation it returned."""

    def __init__(self, inner: RolloutEngine):
        self.inner, self.gens = inner, []

    @property
    def model_step(self) -> int:
        return self.inner.model_step

    def sync_weights(self, model_step: int) -> None:
        self.inner.sync_weights(model_step)

    def load_weights(self, state_dict, model_step: int) -> None:
        self.inner.load_weights(state_dict, model_step)

    def generate(self, prompts, sampling):
        out = self.inner.generate(prompts, sampling)
        self.gens += out
        return out


@pytest.mark.slow  # the transformers model import alone takes seconds
def test_real_hf_engine_through_the_server(tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rltool.engines.hf import HFEngine

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    engine = Tap(HFEngine(Qwen2ForCausalLM(config), tokenizer, model_step=2))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    with SessionServer(engine, tokenizer, sampling) as server:
        server.open_session("hf")
        client = client_for(server, "hf")
        messages: list[dict[str, Any]] = [USER]
        for turn in range(3):
            r = client.chat.completions.create(model="p", messages=messages)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            messages.append({"role": "user", "content": f"Again ({turn})."})
        states = export(server.close_session("hf"), "g", "t", 1.0)
    # every generated token is recorded, supervised, with the engine's logprob and step
    recorded = [
        (t, lp)
        for s in states
        for t, lab, lp in zip(s.input_ids, s.labels, s.logprobs, strict=True)
        if lab != -100
    ]
    produced = [(t, lp) for g in engine.gens for t, lp in zip(g.token_ids, g.logprobs, strict=True)]
    assert recorded == produced and len(produced) == 24  # 3 turns x 8 tokens, no EOS drawn
    assert sum(s.extra["num_turns"] for s in states) == 3
    for s in states:
        assert check_sample(s) == []
        assert set(s.response_model_steps) == {2}


def test_a_refused_request_leaves_the_keep_alive_connection_usable(tokenizer):
    with SessionServer(ScriptedEngine(tokenizer, ["hi"]), tokenizer) as server:
        server.open_session("k")
        body = {"messages": [USER]}
        with httpx.Client(base_url=server.base_url("k")) as http:
            assert http.post("/models", json=body).status_code == 405
            bad = http.post("/chat/completions", content=b"{not json")
            assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
            ok = http.post("/chat/completions", json=body)
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "hi"
            assert http.get(server.url + "/health").json() == {"status": "ok"}
            assert http.get("/nowhere").status_code == 404
