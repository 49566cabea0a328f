"""Producing train batches: prompts in, one grouped batch per step out.

The producer (``producer.py``) draws prompts (``task_sampler``), submits them to a
rollout backend (``backend.py``: in process or Ray workers), files what comes back
in the replay buffer (``buffer.py``), filters groups (``filters.py``), and accounts
for every sample (``result.py``). Teacher scoring for distillation (``teacher.py``)
annotates groups on their way in.
"""
