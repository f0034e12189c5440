"""Engine losses whose clip bounds vary per segment or token: SSPO and DCPO.

SSPO (arXiv 2511.04256, eqs. 13-16): line-break segment ratio, bounds on the ratio itself from the
segment's mean old-policy entropy H_ij (eq. 13):

    b_high = min(1 + alpha + H_ij, gamma)            (eq. 14)
    b_low  = max(0, min(1 - H_ij, beta))             (eq. 15; option "piecewise": clip(1.3 - H, 0.3, beta))

DCPO (Dynamic Clipping Policy Optimization, arXiv 2509.02333): token ratio r_t with bounds that
widen for tokens the old policy found unlikely. DEFINED PLAINLY HERE: we could not read the paper's
equation in the sources available to us, so the bounds below are our derivation from its stated
idea, not a transcription. With q = pi_old(y_t), constrain the change of the token's probability
p = r q in proportion to the ratio's distance from 1, (r - 1) r q <= eps_high above and
(1 - r) r q <= eps_low below; solving the quadratics for the root nearest 1 gives

    b_high = min( 0.5 + 0.5 sqrt(1 + 4 eps_high / q), r_max )
    b_low  = 0.5 + 0.5 sqrt( max(1 - 4 eps_low / q, 0) )

(b_low floors at 0.5 once q < 4 eps_low, where the lower constraint no longer binds). A likely
token (q -> 1) gets roughly GRPO's [1 - eps_low, 1 + eps_high]; a rare one may rise up to r_max.
The defaults eps_low 0.16, eps_high 0.2, r_max 10 are our recollection of the paper's settings,
unverified against its text.
DCPO's other parts (smooth advantage standardisation over steps, its "only token mean" loss) are
not here; we use "seq-mean-token-mean", the closest reduction (per-response token mean; DCPO sums
over responses, which differs by the constant 1/responses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from nemo_sspo.algorithms.bounds import LOWER_BOUND_RULES, entropy_adaptive_bounds
from nemo_sspo.algorithms.losses.base import check_eps, config_error
from nemo_sspo.algorithms.losses.ratio_clip import BoundsContext, RatioLossConfig, ratio_clip_loss
from nemo_sspo.algorithms.losses.registry import register_policy_loss


@dataclass
class SSPOLossConfig(RatioLossConfig):
    """SSPO (arXiv 2511.04256): subsentence ratio (eq. 9), entropy-adaptive bounds (eqs. 13-15).

    Paper settings: 1.5B alpha=0, beta=0.8, gamma=1.75; 7B alpha=0.1, beta=0.8, gamma=2.2.
    """

    segmentation: str = "newline"
    """Segment unit of the ratio (``nemo_sspo.algorithms.segmentation.SEGMENTATIONS``)."""
    segment_k: int | None = None
    """Tokens per segment for segmentation "fixed_k"; None otherwise."""
    alpha: float = 0.0
    """Upper-bound headroom: b_high = min(1 + alpha + H, gamma) (eq. 14)."""
    beta: float = 0.8
    """Lower-bound cap: b_low = max(0, min(1 - H, beta)) (eq. 15)."""
    gamma: float = 1.75
    """Upper-bound cap (eq. 14)."""
    lower_bound: str = "eq15"
    """Lower-bound rule: "eq15" or "piecewise" (clip(1.3 - H, 0.3, beta))."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lower_bound not in LOWER_BOUND_RULES:
            raise config_error(self, f"lower_bound={self.lower_bound!r}; valid: "
                                     f"{LOWER_BOUND_RULES}")
        if self.alpha < 0.0 or not 0.0 <= self.beta <= 1.0 or self.gamma < 1.0:
            raise config_error(self, f"alpha={self.alpha}, beta={self.beta}, gamma={self.gamma}: "
                                     "need alpha >= 0, 0 <= beta <= 1 and gamma >= 1 (so that "
                                     "b_low <= 1 <= b_high)")

    def clip_bounds(self, context: BoundsContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Entropy-adaptive bounds of eqs. 14-15 from the segment entropy H_ij."""
        return entropy_adaptive_bounds(context.segment_entropy, alpha=self.alpha, beta=self.beta,
                                       gamma=self.gamma, lower=self.lower_bound)


@dataclass
class DCPOLossConfig(RatioLossConfig):
    """DCPO (arXiv 2509.02333): token ratio with bounds from the old token probability.

    The bound formula is defined plainly (module docstring), not taken from the paper's text.
    """

    segmentation: ClassVar[str] = "token"
    eps_low: float = 0.16
    """Lower budget: (1 - r) r q <= eps_low; 0 <= eps_low <= 1."""
    eps_high: float = 0.2
    """Upper budget: (r - 1) r q <= eps_high; >= 0."""
    ratio_max: float = 10.0
    """Hard cap of the upper bound for very unlikely tokens; >= 1."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_eps(self, "eps_low", "eps_high")
        if self.ratio_max < 1.0:
            raise config_error(self, f"ratio_max={self.ratio_max} must be >= 1")

    def clip_bounds(self, context: BoundsContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Probability-dependent bounds (module docstring) from q = exp(old log-prob)."""
        old_prob = torch.exp(context.old_logprobs.to(context.segment_entropy.dtype))
        old_prob = old_prob.clamp(min=torch.finfo(old_prob.dtype).tiny)
        b_high = (0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * self.eps_high / old_prob)).clamp(
            max=self.ratio_max)
        b_low = 0.5 + 0.5 * torch.sqrt((1.0 - 4.0 * self.eps_low / old_prob).clamp(min=0.0))
        return b_low, b_high


register_policy_loss("sspo", SSPOLossConfig)(ratio_clip_loss)
register_policy_loss("dcpo", DCPOLossConfig)(ratio_clip_loss)
