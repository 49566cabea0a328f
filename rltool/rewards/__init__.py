"""Reward functions (judgers): each returns a RewardResult with a status, never a silent 0.0."""

from rltool.rewards.gsm8k import RewardResult, extract_answer, gsm8k_reward

__all__ = ["RewardResult", "extract_answer", "gsm8k_reward"]
