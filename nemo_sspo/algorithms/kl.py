"""Per-token Monte-Carlo estimators of a KL divergence (J. Schulman, "Approximating KL
Divergence", 2020; GRPO uses k3 for its reference penalty, DeepSeekMath arXiv 2402.03300 eq. 4).

For KL(p || q) estimated at a token x sampled from p, with ``l = log q(x) - log p(x)``:

- ``k1 = -l``: unbiased, high variance, can be negative.
- ``k2 = l^2 / 2``: biased, low variance, >= 0.
- ``k3 = exp(l) - 1 - l``: unbiased, low variance, >= 0 (GRPO's penalty, q = pi_ref, p = pi_theta).

The rollout tokens are sampled from pi_old, so "KL(pi_theta || pi_ref)" estimated on them is the
usual approximation every GRPO-family trainer makes.
"""

from __future__ import annotations

import torch

from nemo_sspo.algorithms.ratios import LOG_RATIO_CLAMP

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(log_q_over_p: torch.Tensor, estimator: str) -> torch.Tensor:
    """Elementwise KL estimate from ``l = log q(x) - log p(x)`` (module docstring).

    Args:
        log_q_over_p: float tensor of any shape; differentiable.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        Tensor shaped like ``log_q_over_p``. For k3 the exponent is capped at +20: beyond it the
        ``exp`` term is constant (no gradient through it), so a runaway log-ratio gives finite
        values and gradients.

    Raises:
        ValueError: unknown estimator (lists the valid ones).
    """
    if estimator == "k1":
        return -log_q_over_p
    if estimator == "k2":
        return 0.5 * log_q_over_p.square()
    if estimator == "k3":
        return torch.exp(log_q_over_p.clamp(max=LOG_RATIO_CLAMP)) - 1.0 - log_q_over_p
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {KL_ESTIMATORS}")
