"""Tool calls in the Hermes / Qwen2.5 format, and a ChatML template that renders them.

``parse_reply`` turns a reply into an OpenAI assistant message; ``TOOL_CHAT_TEMPLATE``
renders it back to the generated text. Design: docs/agent-loops.md#tool-calls
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

# Qwen2.5-style ChatML: the tools are listed in the system turn, calls are
# rendered from their arguments with tojson, consecutive tool results share one
# user turn. No default system prompt: exactly the messages given.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Function signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and "
    'arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- set call = call.function if call.function is defined else call %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{- (call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True, slots=True)
class Reply:
    """A generated text as an OpenAI assistant message."""

    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI format, arguments as a JSON string

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def _call(raw: str) -> tuple[str, dict[str, Any]] | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return (obj["name"], args) if isinstance(args, dict) else None


def parse_reply(text: str, call_id_prefix: str) -> Reply:
    """Split generated text into content and tool calls.

    A reply with any malformed call (not JSON, no string ``name``, arguments not
    an object) is returned whole as content with no calls: the agent sees what
    the model wrote.
    """
    matches = list(_CALL.finditer(text))
    calls = [_call(m.group(1)) for m in matches]
    if not matches or any(c is None for c in calls):
        return Reply(text, [])
    content = text[: matches[0].start()].removesuffix("\n")
    tool_calls = [
        {
            "id": f"{call_id_prefix}_{i}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
        }
        for i, (name, args) in enumerate(c for c in calls if c is not None)
    ]
    return Reply(content or None, tool_calls)


def template_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """Echoed OpenAI tool calls with ``arguments`` parsed to objects, as templates expect."""
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    out = []
    for i, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{i}] needs function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as exc:
                msg = f"{where}.tool_calls[{i}].function.arguments is not valid JSON: {exc}"
                raise ValueError(msg) from exc
        out.append({**call, "function": {**fn, "arguments": args}})
    return out
