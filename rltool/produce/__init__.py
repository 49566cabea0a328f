"""Producing train batches: prompts in, one grouped batch per step out.

Design (producer, backends, replay buffer, Ray workers, teacher scoring): docs/production.md
"""
