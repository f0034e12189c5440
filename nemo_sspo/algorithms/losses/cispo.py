"""CISPO (Clipped IS-weight Policy Optimization; MiniMax-M1, arXiv 2506.13585, section 3.1).

Instead of clipping the objective (which removes the gradient of clipped tokens), CISPO clips the
importance-sampling weight and detaches it, so every token keeps a REINFORCE-style gradient:

    J = (1 / sum_i |y_i|) sum_i sum_t sg( clip(r_t, 1 - eps_low_is, 1 + eps_high_is) ) A_i log pi_theta(y_t)

with r_t = pi_theta(y_t) / pi_old(y_t) and sg the stop-gradient. The per-token loss returned is
-sg(clip(r_t)) A_i log pi_theta(y_t), exactly the paper's term: its gradient is
-sg(clip(r_t)) A_i grad log pi_theta(y_t). Its *value* includes log pi_theta and therefore does not
compare with the other losses' values (which are -A on-policy); compare gradients or rewards.

Bounds: the paper tunes only the upper bound and sets the lower one high enough never to bind
(eps_low_is = 1 here: lower bound 0); it does not publish its upper value. The default upper
bound 1 + eps_high_is = 5 is ScaleRL's epsilon_max (arXiv 2510.13786), which TRL's GRPOConfig
recommends for ``loss_type="cispo"`` (its ``epsilon_high`` doc: the weight is clamped at 5.0).
The earlier cap 2 is ``eps_high_is=1``.
``clipfrac_*`` counts tokens whose weight was clipped; their gradient is kept, so
``zero_grad_frac_tokens`` is 0. Aggregation: token-mean (the 1 / sum |y_i| above).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_sspo.algorithms.losses.base import LossTerms, PolicyLossConfig, check_eps
from nemo_sspo.algorithms.losses.inputs import LossInputs
from nemo_sspo.algorithms.losses.loss_registry import LossRecord, register_policy_loss
from nemo_sspo.algorithms.ratios import LOG_RATIO_CLAMP


@dataclass
class CISPOLossConfig(PolicyLossConfig):
    """CISPO (arXiv 2506.13585): detached, clipped IS weight times log pi_theta."""

    aggregation: str = "token-mean"
    """Token-level normalisation, as in the paper's objective."""
    eps_low_is: float = 1.0
    """IS weight clipped below at 1 - eps_low_is (1.0: lower bound 0, i.e. open)."""
    eps_high_is: float = 4.0
    """IS weight clipped above at 1 + eps_high_is (4.0: cap 5, ScaleRL's epsilon_max)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_eps(self, "eps_low_is", "eps_high_is")


@dataclass(frozen=True)
class CISPOObjective:
    """Per-token -sg(clip(r_t)) A_i log pi_theta(y_t) (module docstring); token segments."""

    config: CISPOLossConfig

    def __call__(self, inputs: LossInputs, segments: torch.Tensor) -> LossTerms:
        """CISPO's per-token terms of one micro-batch (token segments)."""
        logprobs, mask = inputs.logprobs, inputs.response_mask
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        own_logprobs = torch.where(mask, logprobs, zero)
        log_ratio = torch.where(mask, logprobs.detach() - inputs.old_logprobs, zero)
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        low, high = 1.0 - self.config.eps_low_is, 1.0 + self.config.eps_high_is
        weight = ratio.clamp(low, high)
        adv = inputs.advantages.detach().to(logprobs.dtype).unsqueeze(1)
        return LossTerms(
            per_token_loss=torch.where(mask, -weight * adv * own_logprobs, zero),
            response_mask=mask,
            segments=segments,
            log_ratio=log_ratio,
            ratio=weight,
            clip_low=(ratio < low) & mask,
            clip_high=(ratio > high) & mask,
        )

register_policy_loss(LossRecord("cispo", CISPOLossConfig, CISPOObjective, unit="token"))
