"""An OpenEnv environment for the ``openenv`` loop: guess a secret number, told higher or lower.

``reset(seed)`` picks the secret (1..9) and asks for a guess; each ``step`` reads the last
whole number of the message (the one after ``####`` when there is one: the demo model
answers that way) and answers "higher", "lower" or "correct". The reward is 1.0 on the
step that finds the number, else 0.0; the episode ends then or after ``MAX_GUESSES``.
``GUESS_NUMBER_STEP_LATENCY_S`` makes every step wait that long first (a slow game
server, for the async benchmark).

Served by the openenv loop itself (recipes/openenv_guess.yaml) or by hand:
    uvicorn --app-dir recipes/envs guess_number:app --host 127.0.0.1 --port 8000
"""

from __future__ import annotations

import os
import random
import re
import time
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

LOW, HIGH = 1, 9
MAX_GUESSES = 4
LATENCY_ENV = "GUESS_NUMBER_STEP_LATENCY_S"
_FINAL = re.compile(r"####\s*(-?\d+)")
_NUMBER = re.compile(r"-?\d+")


class GuessAction(Action):
    message: str  # the model's reply; its guess is the number in it


class GuessObservation(Observation):
    message: str  # what the game says to the player


def parse_guess(text: str) -> int | None:
    """The number after ``####``, else the last whole number of ``text``, else None."""
    final = _FINAL.findall(text)
    numbers = final or _NUMBER.findall(text)
    return int(numbers[-1]) if numbers else None


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # no shared state: one instance per session

    def __init__(self) -> None:
        super().__init__()
        self.latency_s = float(os.environ.get(LATENCY_ENV, "0"))
        self._state = State()
        self.secret = LOW

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any):
        self.secret = random.Random(seed).randint(LOW, HIGH)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(
            message=f"I picked a whole number from {LOW} to {HIGH}. What is it? "
            f"You have {MAX_GUESSES} guesses; answer with one number."
        )

    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any):
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        self._state.step_count += 1
        left = MAX_GUESSES - self._state.step_count
        guess = parse_guess(action.message)
        if guess == self.secret:
            return GuessObservation(message="Correct!", reward=1.0, done=True)
        if guess is None:
            hint = f"Answer with one number from {LOW} to {HIGH}."
        else:
            hint = f"My number is {'higher' if guess < self.secret else 'lower'} than {guess}."
        done = left <= 0
        tail = f" It was {self.secret}." if done else f" {left} guesses left."
        return GuessObservation(message=hint + tail, reward=0.0, done=done)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(
    GuessNumberEnvironment, GuessAction, GuessObservation, max_concurrent_envs=256
)
