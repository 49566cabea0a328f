"""The OpenAI Chat Completions subset the session server speaks, plain or streamed (SSE).

By default the distribution knobs (temperature, top_p, top_k) are the recipe's, whatever
the agent asks. Design: docs/agent-loops.md#the-chat-completions-subset
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from rltool.config.schema import SamplingConfig
from rltool.sessions.tool_calls import Reply, template_tool_calls

_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered to the client as OpenAI's ``{"error": {...}}`` body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # normalised for the chat template
    tools: list[dict[str, Any]] | None
    sampling: SamplingConfig


def _text(content: Any, where: str) -> str | None:
    """String content, or the text parts of a content list joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts")


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        raise ApiError(400, f"{where} needs a role, one of {', '.join(_ROLES)}")
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = _text(m.get("content"), where)
    if m.get("tool_calls"):
        try:
            out["tool_calls"] = template_tool_calls(m["tool_calls"], where)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
    else:
        out.pop("tool_calls", None)
    return out


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}], got {value!r}")
    return value


def _sampling(body: dict[str, Any], recipe: SamplingConfig, honor: bool) -> SamplingConfig:
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ApiError(
            400, f"max_completion_tokens / max_tokens must be an integer >= 1, got {limit!r}"
        )
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of them")
    knobs = {}
    if honor:
        knobs = {
            "temperature": float(_number(body, "temperature", recipe.temperature, 0.0, 2.0)),
            "top_p": float(_number(body, "top_p", recipe.top_p, 1e-9, 1.0)),
            "top_k": int(_number(body, "top_k", recipe.top_k, 0, 1 << 30)),
        }
    max_new = recipe.max_new_tokens if limit is None else min(limit, recipe.max_new_tokens)
    return dataclasses.replace(recipe, max_new_tokens=max_new, stop=list(stop), **knobs)


def wants_stream(body: Any) -> tuple[bool, bool]:
    """(stream, include_usage) of a request body: whether to answer with server-sent events,
    and whether their last chunk carries the usage (``stream_options.include_usage``)."""
    if not isinstance(body, dict):
        return False, False
    stream, options = body.get("stream", False), body.get("stream_options")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object")
    usage = bool((options or {}).get("include_usage", False))
    return stream, stream and usage


def parse_chat_request(body: Any, recipe: SamplingConfig, honor_sampling: bool) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    wants_stream(body)  # checked here too: a bad stream field is a 400 before generating
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: one session records one trajectory")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools must be a list")
    return ChatRequest(
        messages=[_message(m, i) for i, m in enumerate(messages)],
        tools=tools,
        sampling=_sampling(body, recipe, honor_sampling),
    )


def chat_response(
    completion_id: str,
    model: str,
    reply: Reply,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """An OpenAI ``chat.completion`` object with one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if reply.tool_calls else finish_reason,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def chat_chunks(response: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A ``chat.completion`` answered as the ``chat.completion.chunk`` objects of a stream.
    The reply is generated whole before the first chunk (the engine's batcher answers whole
    turns), so the content comes in one chunk and each tool call in one chunk of its own."""
    choice = response["choices"][0]
    message = choice["message"]
    head = {k: response[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        one = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {**head, "choices": [one]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return chunks


def sse_body(chunks: list[dict[str, Any]]) -> bytes:
    """Server-sent events: one ``data:`` event per chunk, then ``data: [DONE]``."""
    events = [f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks]
    return ("".join(events) + "data: [DONE]\n\n").encode()
