"""The calculator agent: a GSM8K question, a ``calculator`` tool, and a checked final answer.

Run by the ``localhost`` loop (``agent: rltool.agents.calculator:run``,
``judger: rltool.agents.calculator:judge``). Design: docs/agent-loops.md#the-calculator-agent
"""

from __future__ import annotations

import ast
import json
import operator
import re
from fractions import Fraction
from typing import Any

from rltool.rewards.gsm8k import extract_answer, gsm8k_reward

MODEL = "rltool-policy"  # the session server serves one model, whatever the name
MAX_TOOL_ROUNDS = 2  # tool-call rounds before the agent stops asking
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,  # on Fractions: exact
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# "a op b" as the model writes it in "7 + 5 = 12"
_FIRST_OPERATION = re.compile(r"(-?\d+(?:\.\d+)?)\s*([-+*/x×])\s*(-?\d+(?:\.\d+)?)")


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise ValueError(f"exponent must be an integer of at most {MAX_EXPONENT}")
        if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise ValueError("division by zero")
        result = _BINARY[type(node.op)](left, right)
        if abs(result) > MAX_MAGNITUDE:
            raise ValueError(f"result larger than {MAX_MAGNITUDE:.0e}")
        return result
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")


def format_number(x: Fraction) -> str:
    """An integer as digits, anything else as a decimal rounded to 6 places."""
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.6f}".rstrip("0").rstrip(".")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses).

    ValueError, with the reason, for anything else (names, calls, huge numbers).
    """
    text = expression.strip().replace("×", "*").replace("^", "**")
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression must have 1 to {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from exc
    return format_number(_value(tree.body))


def run_tool_call(call: Any) -> str:
    """Tool message content for one OpenAI tool call (errors are told to the model)."""
    fn = call.function
    if fn.name != "calculator":
        return f"error: unknown tool {fn.name!r}; the only tool is calculator"
    try:
        args = json.loads(fn.arguments or "{}")
        expression = str(args["expression"])
        return f"{expression} = {calculate(expression)}"
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return f'error: arguments must be {{"expression": "..."}} ({exc})'
    except ValueError as exc:
        return f"error: {exc}"


def first_operation(answer: str) -> str | None:
    """The first ``a op b`` of an answer as an expression (``x`` and ``×`` read as ``*``)."""
    match = _FIRST_OPERATION.search(answer)
    if match is None:
        return None
    a, op, b = match.groups()
    return f"{a} {'*' if op in 'x×' else op} {b}"


def check_feedback(answer: str) -> str:
    """The calculator's verdict on the first ``a op b`` of an answer, as a user message."""
    expression = first_operation(answer)
    ask = "give the final answer as #### N"
    if expression is None:
        return f"calculator: no expression found in your answer; write it as a + b = c, then {ask}"
    try:
        return f"calculator: {expression} = {calculate(expression)}; {ask}"
    except ValueError as exc:
        return f"calculator: {expression}: {exc}; {ask}"


def _message(reply: Any) -> dict[str, Any]:
    """The assistant message echoed back as the request history expects it."""
    out: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in reply.tool_calls]
    return out


def _ask(client: Any, messages: list[dict[str, Any]]) -> Any:
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[CALCULATOR_TOOL]
    )
    return response.choices[0].message


def run(client: Any, task: dict[str, Any]) -> str:
    """One episode; returns the final assistant text (what ``judge`` scores)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(task["question"])}]
    reply = _ask(client, messages)
    messages.append(_message(reply))
    if not reply.tool_calls:
        messages.append({"role": "user", "content": check_feedback(reply.content or "")})
        return _ask(client, messages).content or ""
    for _ in range(MAX_TOOL_ROUNDS):
        for call in reply.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": run_tool_call(call)}
            )
        reply = _ask(client, messages)
        if not reply.tool_calls:
            break
        messages.append(_message(reply))
    return reply.content or ""


def judge(task: dict[str, Any], final_text: str) -> float:
    """1.0 when the number after ``####`` (else the last number) matches the task's answer."""
    answer = str(task["answer"])
    result = gsm8k_reward(final_text, extract_answer(answer) or answer.strip())
    if result.status == "error":
        raise ValueError(f"gsm8k reward: {result.error}")
    assert result.score is not None
    return result.score
