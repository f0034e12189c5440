"""Engine losses whose clip bounds vary per segment or token: SSPO and DCPO.

SSPO (arXiv 2511.04256, eqs. 13-16): line-break segment ratio, bounds on the ratio itself from the
segment's mean old-policy entropy H_ij (eq. 13):

    b_high = min(1 + alpha + H_ij, gamma)            (eq. 14)
    b_low  = max(0, min(1 - H_ij, beta))             (eq. 15; option "piecewise": clip(1.3 - H, 0.3, beta))

DCPO (Dynamic Clipping Policy Optimization, arXiv 2509.02333; official code lime-RL/DCPO): token
ratio r_t with bounds that widen for tokens the old policy found unlikely. With q = pi_old(y_t),
the paper constrains the change of the token's probability p = r q by |(r - 1) r| q <= eps, whose
roots nearest 1 are its dynamic adaptive clipping bounds (paper section 4.1; verl/trainer/ppo/
core_algos.py, ``get_clip_low_high`` with ``clip_type: dynamic``):

    b_low  = 0.5 + 0.5 sqrt( max(1 - 4 eps_low / q, 0) )
    b_high = min( 0.5 + 0.5 sqrt(1 + 4 eps_high / q), r_max )

(b_low floors at 0.5 once q < 4 eps_low). The official code caps b_high at max(c, 10) and applies
the dual clip c to A < 0 tokens as well (loss at most -c A). Defaults are the shipped run
(recipe/dcpo/run_dcpo.sh over run_base.sh): eps_low 0.2, eps_high 0.28, c = 10, so r_max = 10,
loss_agg_mode "only-token-mean", which the code computes as the token mean over the batch it is
given ("token-mean" here; the paper's equation writes a per-response token sum instead, which
"seq-mean-token-sum" gives). The paper's table uses eps_low 0.16, eps_high 0.2 (set them to
compare).

DCPO's smooth advantage standardisation (paper section 4.2, code ``compute_dcpo_outcome_advantage``;
``nemo_sspo.algorithms.advantages.smooth_group_advantages``) mixes each prompt's current-step group
statistics with its statistics accumulated over all earlier visits. It is an advantage estimator
(``dcpo_smooth``, ``nemo_sspo.algorithms.advantage_estimators.DCPO_SMOOTH``), not a field of the
loss: a host selects it and keeps the per-prompt history. Not this loss's default, as shipped: run_base.sh passes
``reward_model.use_old_mean.enable=${USE_OLD_MEAN_ENABLE:-False}`` and run_dcpo.sh never sets it,
so the shipped run's advantages are the plain group z-scores; the paper's SAS results need it on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_sspo.algorithms.bounds import LOWER_BOUND_RULES, entropy_adaptive_bounds
from nemo_sspo.algorithms.losses.base import (
    PolicyLossConfig,
    check_eps,
    check_segmentation,
    config_error,
)
from nemo_sspo.algorithms.losses.ratio_clip import (
    BoundsContext,
    HardClip,
    RatioEngine,
    check_dual_clip,
)
from nemo_sspo.algorithms.losses.loss_registry import LossRecord, register_policy_loss


@dataclass
class SSPOLossConfig(PolicyLossConfig):
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
        check_segmentation(self)
        if self.lower_bound not in LOWER_BOUND_RULES:
            raise config_error(self, f"lower_bound={self.lower_bound!r}; valid: "
                                     f"{LOWER_BOUND_RULES}")
        if self.alpha < 0.0 or not 0.0 <= self.beta <= 1.0 or self.gamma < 1.0:
            raise config_error(self, f"alpha={self.alpha}, beta={self.beta}, gamma={self.gamma}: "
                                     "need alpha >= 0, 0 <= beta <= 1 and gamma >= 1 (so that "
                                     "b_low <= 1 <= b_high)")


@dataclass
class DCPOLossConfig(PolicyLossConfig):
    """DCPO (arXiv 2509.02333, code lime-RL/DCPO): token ratio with bounds from the old token
    probability, dual clip for A < 0 (module docstring; defaults from the shipped run).
    """

    eps_low: float = 0.2
    """Lower budget: (1 - r) r q <= eps_low; 0 <= eps_low <= 1 (run_base.sh: 0.2)."""
    eps_high: float = 0.28
    """Upper budget: (r - 1) r q <= eps_high; >= 0 (run_dcpo.sh: 0.28)."""
    ratio_max: float = 10.0
    """Hard cap of the upper bound for very unlikely tokens; >= 1 (code: max(c, 10) = 10)."""
    dual_clip_c: float | None = 10.0
    """Dual-clip constant c > 1 for A < 0 tokens (run_dcpo.sh: clip_ratio_c 10); None disables."""
    aggregation: str = "token-mean"
    """The code's "only-token-mean" (module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_eps(self, "eps_low", "eps_high")
        check_dual_clip(self)
        if self.ratio_max < 1.0:
            raise config_error(self, f"ratio_max={self.ratio_max} must be >= 1")


@dataclass(frozen=True)
class EntropyAdaptiveBounds:
    """SSPO's bounds (eqs. 14-15) from the segment entropy H_ij of the context."""

    config: SSPOLossConfig

    def __call__(self, context: BoundsContext) -> tuple[torch.Tensor, torch.Tensor]:
        """SSPO's (b_low, b_high) at every token from its segment's entropy (eqs. 14-15)."""
        c = self.config
        return entropy_adaptive_bounds(context.segment_entropy, alpha=c.alpha, beta=c.beta,
                                       gamma=c.gamma, lower=c.lower_bound)


@dataclass(frozen=True)
class OldProbabilityBounds:
    """DCPO's bounds (module docstring) from q = exp(old log-prob) of each token."""

    config: DCPOLossConfig

    def __call__(self, context: BoundsContext) -> tuple[torch.Tensor, torch.Tensor]:
        """DCPO's (b_low, b_high) at every token from its old probability (module docstring)."""
        c = self.config
        old_prob = torch.exp(context.old_logprobs).clamp(min=torch.finfo(context.old_logprobs.dtype).tiny)
        b_high = (0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * c.eps_high / old_prob)).clamp(max=c.ratio_max)
        b_low = 0.5 + 0.5 * torch.sqrt((1.0 - 4.0 * c.eps_low / old_prob).clamp(min=0.0))
        return b_low, b_high


register_policy_loss(LossRecord("sspo", SSPOLossConfig,
                                lambda c: RatioEngine(HardClip(EntropyAdaptiveBounds(c))),
                                reads_old_entropy=True))
register_policy_loss(LossRecord("dcpo", DCPOLossConfig,
                                lambda c: RatioEngine(HardClip(OldProbabilityBounds(c), c.dual_clip_c)),
                                unit="token"))
