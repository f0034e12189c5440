"""Rewards: math-verify scoring of the last ``\\boxed{}`` answer, in a process pool."""

from nemo_sspo.rewards.math_reward import MathVerifyReward, extract_last_boxed, parse_gold, score_response

__all__ = ["MathVerifyReward", "extract_last_boxed", "parse_gold", "score_response"]
