"""vf_arith: a verifiers 0.4 environment written against its public API only.

Arithmetic word problems with a calculator tool: the model may call ``add`` /
``multiply`` (an MCP tool server per rollout, launched by verifiers) and answers with
the number. Rewards: ``correct`` (1.0 when the last number of the reply is the answer)
and ``uses_tool`` (weight 0.0: logged, not summed). The taskset's ``split`` (train |
eval) and ``seed`` draw disjoint problem sets.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

from vf_arith.tools import CalculatorTools

__all__ = ["ArithTaskset"]

SYSTEM = (
    "Solve the problem. You may call the add or multiply tool. "
    "End your reply with the final number."
)
_NUMBER = re.compile(r"-?\d+")


class ArithConfig(vf.TasksetConfig):
    split: str = "train"  # train | eval: disjoint seeds
    size: int = 64
    seed: int = 0


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [CalculatorTools(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        numbers = _NUMBER.findall(trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == task.answer)

    @vf.reward(weight=0.0)
    async def uses_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


def problem(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
    if rng.random() < 0.5:
        return f"Tom has {a} apples and buys {b} more. How many apples does he have?", a + b
    return f"There are {a} boxes with {c} pens each. How many pens are there?", a * c


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        if self.config.split not in ("train", "eval"):
            raise ValueError(f"split must be train or eval, got {self.config.split!r}")
        # eval draws from another seed stream than train: the sets are disjoint in draws
        rng = random.Random(f"{self.config.split}-{self.config.seed}")
        for i in range(self.config.size):
            question, answer = problem(rng)
            data = ArithData(id=f"{self.config.split}-{i}", prompt=question, answer=answer)
            yield ArithTask(data.model_copy(update={"system_prompt": SYSTEM}), self.config.task)
