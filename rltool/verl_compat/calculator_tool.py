"""A verl ``BaseTool`` around rltool's safe calculator (needs verl: scripts/verl_env.sh).

verl's ``ToolAgentLoop`` loads tools from a tool config YAML (``class_name``,
``config: {type: native}``, ``tool_schema``); ``calculator_tool.yaml`` beside
this file declares this one, and ``agent_loop.options.multi_turn.tool_config_path:
builtin:calculator_tool.yaml`` points a recipe at it. rltool itself never
imports this module: verl does, when it loads the tool config.
"""

from __future__ import annotations

from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

from rltool.agents.calculator import calculate


class CalculatorTool(BaseTool):
    """``calculator(expression)``: the value of an arithmetic expression, or the error."""

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        expression = str(parameters.get("expression", ""))
        try:
            text = f"{expression} = {calculate(expression)}"
        except ValueError as exc:  # told to the model, as a calculator would
            text = f"error: {exc}"
        return ToolResponse(text=text), 0.0, {}
