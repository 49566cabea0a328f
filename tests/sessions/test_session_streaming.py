"""Streamed chat completions (``stream: true``): server-sent events that the official
``openai`` client assembles into the same reply, with the same recording."""

from __future__ import annotations

import json

import openai
import pytest
from session_fakes import ADD_TOOL, ANSWER_TEXT, CALL_TEXT, ScriptedEngine

from rltool.config.schema import SamplingConfig
from rltool.sessions import SessionServer, export
from rltool.sessions.protocol import ApiError, chat_chunks, sse_body, wants_stream

try:
    import httpx2 as httpx  # the HTTP client under recent openai releases
except ImportError:
    import httpx

USER = {"role": "user", "content": "What is 2 + 3?"}


def _record(tokenizer, stream: bool):
    """Two turns (a tool call, then the answer), streamed or not: the replies and the
    recorded sample."""
    engine = ScriptedEngine(tokenizer, [CALL_TEXT, ANSWER_TEXT], model_step=2)
    with SessionServer(engine, tokenizer, SamplingConfig(max_new_tokens=64)) as server:
        server.open_session("s")
        client = openai.OpenAI(base_url=server.base_url("s"), api_key="-", max_retries=0)
        replies, messages = [], [USER]
        for _ in range(2):
            kwargs = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            out = client.chat.completions.create(
                model="p", messages=messages, tools=[ADD_TOOL], **kwargs
            )
            replies.append(list(out) if stream else out)
            if stream:
                chunks = replies[-1]
                calls = [
                    c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []
                ]
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            else:
                calls, text = (
                    out.choices[0].message.tool_calls or [],
                    out.choices[0].message.content,
                )
            message = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": c.function.model_dump()}
                    for c in calls
                ]
                messages = [
                    *messages,
                    message,
                    {"role": "tool", "tool_call_id": calls[0].id, "content": "5"},
                ]
        (state,) = export(server.close_session("s"), "g", "calc", 1.0)
    return replies, state


def test_a_streamed_conversation_records_what_the_plain_one_records(tokenizer):
    (call_chunks, answer_chunks), streamed = _record(tokenizer, stream=True)
    (call_reply, answer_reply), plain = _record(tokenizer, stream=False)
    assert streamed.input_ids.tolist() == plain.input_ids.tolist()
    assert streamed.labels.tolist() == plain.labels.tolist()
    assert streamed.logprobs.tolist() == plain.logprobs.tolist()
    # role first, then the tool call, then the finish; usage last with no choice
    assert call_chunks[0].choices[0].delta.role == "assistant"
    (call,) = call_chunks[1].choices[0].delta.tool_calls
    assert call.index == 0 and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert [c.choices[0].finish_reason for c in call_chunks[:-1]] == [None, None, "tool_calls"]
    assert call_chunks[-1].choices == []
    assert call_chunks[-1].usage.model_dump() == call_reply.usage.model_dump()
    text = "".join(c.choices[0].delta.content or "" for c in answer_chunks if c.choices)
    assert text == ANSWER_TEXT == answer_reply.choices[0].message.content
    assert answer_chunks[-2].choices[0].finish_reason == "stop"
    assert {c.id for c in answer_chunks} == {answer_reply.id} == {"chatcmpl-s-1"}


def test_the_wire_is_server_sent_events_ending_in_done(tokenizer):
    engine = ScriptedEngine(tokenizer, [ANSWER_TEXT])
    with SessionServer(engine, tokenizer) as server:
        server.open_session("w")
        body = {"model": "p", "messages": [USER], "stream": True}
        r = httpx.post(server.base_url("w") + "/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 3
    assert "usage" not in chunks[-1]  # only with stream_options.include_usage


def test_a_stream_that_fails_before_its_first_byte_is_a_json_error(tokenizer):
    engine = ScriptedEngine(tokenizer, [ANSWER_TEXT])
    with SessionServer(engine, tokenizer) as server:
        server.open_session("e")
        client = openai.OpenAI(base_url=server.base_url("e"), api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            client.chat.completions.create(model="p", messages=[USER], n=2, stream=True)


def test_stream_fields_are_checked():
    assert wants_stream({"stream": True}) == (True, False)
    assert wants_stream({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    assert wants_stream({"stream": False, "stream_options": {"include_usage": True}}) == (
        False,
        False,
    )
    assert wants_stream({"stream": None}) == (False, False)
    with pytest.raises(ApiError, match="stream must be true or false"):
        wants_stream({"stream": "yes"})
    with pytest.raises(ApiError, match="stream_options must be an object"):
        wants_stream({"stream": True, "stream_options": 1})


def test_chunks_of_an_empty_reply_hold_the_role_and_the_finish_only():
    answer = {
        "id": "c", "created": 1, "model": "m", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                     "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1},
    }  # fmt: skip
    chunks = chat_chunks(answer, include_usage=False)
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sse_body(chunks).endswith(b"\n\ndata: [DONE]\n\n")
