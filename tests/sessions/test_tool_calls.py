"""Hermes-format parsing and the template round trip of a parsed reply."""

from __future__ import annotations

import json

import pytest
from session_fakes import GEN_PROMPT, render_text

from rltool.sessions.tool_calls import parse_reply, template_tool_calls

TWO_CALLS = (
    "Adding twice.\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 1}}\n</tool_call>'
)


def test_parse_content_and_two_calls():
    reply = parse_reply(TWO_CALLS, "call_4")
    assert reply.content == "Adding twice."
    assert [c["id"] for c in reply.tool_calls] == ["call_4_0", "call_4_1"]
    assert [json.loads(c["function"]["arguments"]) for c in reply.tool_calls] == [
        {"a": 2, "b": 3},
        {"a": 5, "b": 1},
    ]
    assert reply.message()["role"] == "assistant"


def test_plain_text_and_malformed_calls_are_content():
    assert parse_reply("just text", "c").tool_calls == []
    bad = '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>'
    assert parse_reply(bad, "c").content == bad and parse_reply(bad, "c").tool_calls == []
    assert parse_reply("<tool_call>{oops}</tool_call>", "c").tool_calls == []


@pytest.mark.parametrize(
    "text",
    [
        TWO_CALLS,
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        "Thinking.\n\n"  # two newlines: content keeps one
        '<tool_call>\n{"name": "f", "arguments": {"s": "é"}}\n</tool_call>',
        "no calls at all",
    ],
)
def test_parsed_reply_renders_back_to_the_generated_text(tokenizer, text):
    user = [{"role": "user", "content": "hi"}]
    reply = parse_reply(text, "c").message()
    if "tool_calls" in reply:
        reply["tool_calls"] = template_tool_calls(reply["tool_calls"], "reply")
    before = render_text(tokenizer, user, gen=True)
    after = render_text(tokenizer, [*user, reply], gen=False)
    assert before.endswith(GEN_PROMPT)
    assert after == before + text + "<|im_end|>\n"


def test_non_canonical_layout_parses_but_does_not_render_back(tokenizer):
    text = '<tool_call>{"name":"add","arguments":{"a":2}}</tool_call>'
    reply = parse_reply(text, "c").message()
    assert reply["tool_calls"][0]["function"]["name"] == "add"
    reply["tool_calls"] = template_tool_calls(reply["tool_calls"], "reply")
    user = [{"role": "user", "content": "hi"}]
    after = render_text(tokenizer, [*user, reply], gen=False)
    assert text not in after


def test_echoed_arguments_must_be_json():
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]
    with pytest.raises(ValueError, match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments"):
        template_tool_calls(calls, "messages[2]")
