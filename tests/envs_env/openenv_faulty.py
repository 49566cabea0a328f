"""TEST FIXTURE: an OpenEnv environment whose step raises on a guess of 0 (served by the
openenv loop from ``app: openenv_faulty:app``, ``app_dir: tests/envs_env``); any other guess
is the guess-number game's step."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "envs"))

from guess_number import (
    GuessAction,
    GuessNumberEnvironment,
    GuessObservation,
    parse_guess,
)
from openenv.core.env_server import create_fastapi_app


class FaultyEnvironment(GuessNumberEnvironment):
    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any):
        if parse_guess(action.message) == 0:
            raise ZeroDivisionError("the reward function divided by zero")
        return super().step(action, timeout_s, **kw)


app = create_fastapi_app(FaultyEnvironment, GuessAction, GuessObservation, max_concurrent_envs=64)
