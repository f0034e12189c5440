"""Entropy-adaptive clip bounds of SSPO (arXiv 2511.04256, eqs. 14 and 15).

The bounds apply to the ratio itself (not to ``ratio - 1``): a segment on which the old policy was
uncertain (high entropy H_ij) may move further up, and a low-entropy segment is kept closer to 1
from below.
"""

from __future__ import annotations

import torch

LOWER_BOUND_RULES = ("eq15", "piecewise")

# Constants of the piecewise lower bound from an earlier public summary of SSPO:
# b_low = clip(1.3 - H, 0.3, 0.8). Its upper cap 0.8 is the paper's beta, so beta is used for it.
_PIECEWISE_OFFSET = 1.3
_PIECEWISE_FLOOR = 0.3


def entropy_adaptive_bounds(
    segment_entropy: torch.Tensor,
    *,
    alpha: float,
    beta: float,
    gamma: float,
    lower: str = "eq15",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip bounds ``(b_low, b_high)`` for each segment from its old-policy entropy.

    eq. 14: ``b_high = min(1 + alpha + H, gamma)``.
    eq. 15 (``lower="eq15"``): ``b_low = max(0, min(1 - H, beta))``.
    ``lower="piecewise"``: ``b_low = clip(1.3 - H, 0.3, beta)`` (= clip(1.3 - H, 0.3, 0.8) at the
    paper's beta = 0.8).

    Args:
        segment_entropy: float tensor of any shape, H_ij in nats (eq. 13: mean old-policy token
            entropy over the segment). Treated as a constant: the result carries no gradient.
        alpha: extra headroom of the upper bound (paper: 0 for 1.5B, 0.1 for 7B).
        beta: cap of the lower bound (paper: 0.8).
        gamma: cap of the upper bound (paper: 1.75 for 1.5B, 2.2 for 7B).
        lower: ``"eq15"`` or ``"piecewise"``.

    Returns:
        ``(b_low, b_high)``, each shaped and typed like ``segment_entropy``.

    Raises:
        ValueError: unknown ``lower`` rule.
    """
    if lower not in LOWER_BOUND_RULES:
        raise ValueError(f"unknown lower bound rule {lower!r}; valid rules: {LOWER_BOUND_RULES}")
    entropy = segment_entropy.detach()
    b_high = (1.0 + alpha + entropy).clamp(max=gamma)
    if lower == "eq15":
        b_low = (1.0 - entropy).clamp(max=beta).clamp(min=0.0)
    else:
        b_low = (_PIECEWISE_OFFSET - entropy).clamp(min=_PIECEWISE_FLOOR).clamp(max=beta)
    return b_low, b_high
