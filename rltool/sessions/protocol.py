"""The OpenAI Chat Completions subset the session server speaks (non-streaming).

By default the distribution knobs (temperature, top_p, top_k) are the recipe's, whatever
the agent asks. Design: docs/agent-loops.md#the-chat-completions-subset
"""

from __future__ import annotations

import dataclasses
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


def parse_chat_request(body: Any, recipe: SamplingConfig, honor_sampling: bool) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("stream"):
        raise ApiError(400, "stream=true is not supported by the rltool session server")
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
