"""Rollout engines: the ``RolloutEngine`` interface, its registry, the HF engine, the batcher."""
