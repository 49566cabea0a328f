"""Agent loops: tasks in, canonical RolloutStates out (gsm8k, localhost, openenv, sandbox, verl)."""
