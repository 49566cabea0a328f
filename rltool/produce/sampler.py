"""Deterministic prompt order with a resumable position.

Each epoch is a permutation of the dataset drawn from ``seed + epoch``; the
position (epoch, index) is all a checkpoint needs to hand the next step the
same prompts an uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PromptSampler:
    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        if size <= 0:
            raise ValueError("the training data is empty")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng(self.seed + epoch).permutation(self.size)

    def take(self, n: int) -> list[int]:
        """The next ``n`` dataset indices, crossing epochs as needed."""
        out: list[int] = []
        while len(out) < n:
            if self.index == self.size:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            k = min(n - len(out), self.size - self.index)
            out.extend(int(i) for i in self._order[self.index : self.index + k])
            self.index += k
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size:
            raise ValueError(
                f"checkpoint was taken on {state['size']} training examples, the data now has "
                f"{self.size}; resume with the same data files"
            )
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)
