"""Truncated importance sampling (TIS) between the rollout engine and the trainer.

The engine that samples (vLLM in bf16 with its own kernels, or any engine with ``top_p < 1``) does
not assign exactly the probabilities the trainer computes for the same weights, so the samples come
from pi_rollout, not from pi_old. Per token t the correction weight is

    w_t = min( pi_old(y_t) / pi_rollout(y_t), C ) = min( exp(logp_old_t - logp_rollout_t), C )

(``C = rollout.tis_cap``, a constant: no gradient flows through it). The trainer multiplies each
token's policy loss by w_t before aggregation (Yao et al., "Your efficient RL framework secretly
brings you off-policy RL training", 2025; verl's ``rollout_is``). Truncation at C bounds the variance;
tokens the engine under-samples relative to the trainer (w_t < 1) are down-weighted untruncated.
"""

from __future__ import annotations

import math

import torch

from nemo_sspo.metrics import MetricPair, mean_pair

__all__ = ["truncated_is_weights"]


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, dict[str, MetricPair]]:
    """Per-token TIS weights and their metrics (module docstring).

    Args:
        old_logprobs: ``[B, S]`` float32, the trainer's log pi_old of each target token.
        rollout_logprobs: ``[B, S]`` float32, the engine's log-prob of the same tokens (same frame).
        mask: ``[B, S]`` bool, True on response tokens.
        cap: C >= 1.

    Returns:
        ``(weights, metrics)``: weights ``[B, S]`` float32, detached, ``min(exp(old - rollout), cap)``
        on the mask and 1.0 elsewhere; metrics ``rollout/tis_weight_mean`` (mean weight over masked
        tokens) and ``rollout/tis_clipped_frac`` (share of masked tokens whose ratio exceeded the cap)
        as ``"mean"`` metric pairs.

    Raises:
        ValueError: ``cap < 1`` or shapes that differ.
    """
    if cap < 1:
        raise ValueError(f"cap={cap} must be >= 1 (a cap below 1 would shrink on-policy tokens too)")
    if not old_logprobs.shape == rollout_logprobs.shape == mask.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape")
    log_ratio = (old_logprobs.detach().float() - rollout_logprobs.detach().float())
    log_cap = math.log(cap)
    # Clamp the exponent, not the weight: exp of a large log-ratio would overflow first (docs/pitfalls.md#p3).
    weights = torch.where(mask, torch.exp(log_ratio.clamp(max=log_cap)), torch.ones_like(log_ratio))
    count = mask.sum()
    metrics = {
        "rollout/tis_weight_mean": mean_pair(weights[mask].sum(), count),
        "rollout/tis_clipped_frac": mean_pair((log_ratio > log_cap)[mask].sum(), count),
    }
    return weights, metrics
