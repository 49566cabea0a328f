"""The calculator tools of vf_arith, an MCP server verifiers launches per rollout
(``python -m vf_arith.tools``)."""

from __future__ import annotations

import verifiers.v1 as vf


class CalculatorTools(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b


if __name__ == "__main__":
    CalculatorTools.run()
