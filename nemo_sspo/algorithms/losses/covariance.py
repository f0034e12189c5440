"""Clip-Cov and KL-Cov (arXiv 2505.22617, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", section 4): restrict the update of the few tokens whose log-prob
covaries most with their advantage, the tokens that drive entropy collapse.

Token covariance over the N valid tokens of the batch the loss sees (all means over those tokens):

    Cov_t = ( log pi_theta(y_t) - mean log pi_theta ) * ( A_t - mean A )      (no gradient)

- ``clip_cov``: GRPO's clipped token objective, and the gradient of the selected tokens is detached.
  The paper picks floor(r N) tokens at random among those with Cov_t in [omega_low, omega_high]
  (r = 2e-4, band [1, 5] in its runs); we take the max(1, floor(r N)) highest-covariance tokens of
  that band, deterministically, so runs and parallel layouts reproduce.
- ``kl_cov``: unclipped token objective r_t A_t; the max(1, floor(k N)) highest-covariance tokens get a
  penalty beta * KL on top (k = 2e-3, beta = 1 as we read the paper's runs). We estimate the
  token's KL(pi_old || pi_theta) by |log r_t| (our choice: 0 on-policy, grows either way).

Selection is local to the batch passed to the loss (one micro-batch), not global over the step;
``policy/cov_selected_frac`` reports the selected share so this is visible. The quota is at
least one token when fraction > 0 and the micro-batch has a valid token (floor(fraction N) alone
is 0 for small micro-batches, which would make the loss its base objective); fraction = 0
selects nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from nemo_sspo.algorithms.losses.base import (
    LossTerms,
    check_loss_inputs,
    config_error,
    finish_policy_loss,
)
from nemo_sspo.algorithms.losses.metrics import pair
from nemo_sspo.algorithms.losses.ratio_clip import (
    BoundsContext,
    GRPOLossConfig,
    RatioLossConfig,
    Surrogate,
    ratio_objective,
    unclipped_surrogate,
)
from nemo_sspo.algorithms.losses.registry import register_policy_loss


def select_high_covariance_tokens(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    fraction: float,
    *,
    cov_min: float = -math.inf,
    cov_max: float = math.inf,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The max(1, floor(fraction * N)) highest-covariance valid tokens with Cov_t in [cov_min, cov_max].

    The quota is at least one token whenever ``fraction > 0`` and the micro-batch has a valid
    token (N >= 1): with the papers' fractions (2e-4, 2e-3) floor(fraction * N) is 0 for any
    micro-batch under 500-5000 tokens, which would silently turn Clip-Cov into GRPO and KL-Cov into
    the unclipped objective. ``fraction = 0`` selects nothing. Only eligible tokens are selected,
    so fewer than the quota may be.

    Args:
        logprobs: ``[B, T]`` float, log pi_theta of the sampled tokens (read without gradient).
        advantages: ``[B]`` float, one advantage per response.
        response_mask: ``[B, T]`` bool.
        fraction: share of the N valid tokens to select, in [0, 1].
        cov_min, cov_max: eligibility band of Cov_t.

    Returns:
        ``(selected [B, T] bool, covariance [B, T] float)``; covariance is 0 at masked positions.
        Ties keep the earlier position (row-major). No host synchronisation.
    """
    mask = response_mask
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    valid = mask.to(dtype)
    count = valid.sum().clamp(min=1)
    lp = torch.where(mask, logprobs.detach().to(dtype), zero)
    adv = torch.where(mask, advantages.detach().to(dtype).unsqueeze(1).expand_as(lp), zero)
    covariance = (lp - lp.sum() / count) * (adv - adv.sum() / count) * valid
    eligible = mask & (covariance >= cov_min) & (covariance <= cov_max)
    quota = torch.floor(fraction * valid.sum())
    if fraction > 0:  # at least one token, else small micro-batches never select (floor -> 0)
        quota = quota.clamp(min=1.0)
    key = torch.where(eligible, covariance, torch.full_like(covariance, -math.inf)).reshape(-1)
    order = torch.sort(key, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    selected = (rank.reshape(mask.shape) < quota) & eligible
    return selected, covariance


class _CovarianceConfig(RatioLossConfig):
    """Selection fields' checks and the per-token change applied to selected tokens."""

    cov_min: ClassVar[float] = -math.inf
    cov_max: ClassVar[float] = math.inf

    def _check_selection(self) -> None:
        if not 0.0 <= self.select_fraction <= 1.0:
            raise config_error(self, f"select_fraction={self.select_fraction} must lie in [0, 1]")
        if self.cov_min > self.cov_max:
            raise config_error(self, f"cov_min={self.cov_min} > cov_max={self.cov_max}")

    def apply_selection(self, terms: LossTerms, selected: torch.Tensor,
                        log_ratio: torch.Tensor) -> LossTerms:
        raise NotImplementedError


@dataclass
class ClipCovLossConfig(GRPOLossConfig, _CovarianceConfig):
    """Clip-Cov (arXiv 2505.22617): GRPO objective, gradient detached on high-covariance tokens."""

    aggregation: str = "token-mean"
    """The paper's runs use token-level normalisation."""
    select_fraction: float = 2e-4
    """r: share of tokens whose gradient is detached."""
    cov_min: float = 1.0
    """omega_low: lower edge of the eligible covariance band."""
    cov_max: float = 5.0
    """omega_high: upper edge of the eligible covariance band."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_selection()

    def apply_selection(self, terms: LossTerms, selected: torch.Tensor,
                        log_ratio: torch.Tensor) -> LossTerms:
        loss = terms.per_token_loss
        return replace(terms, per_token_loss=torch.where(selected, loss.detach(), loss),
                       grad_zero=terms.grad_zero | selected)


@dataclass
class KLCovLossConfig(_CovarianceConfig):
    """KL-Cov (arXiv 2505.22617): unclipped objective plus a KL penalty on high-covariance tokens."""

    segmentation: ClassVar[str] = "token"
    aggregation: str = "token-mean"
    """The paper's runs use token-level normalisation."""
    select_fraction: float = 2e-3
    """k: share of tokens that get the penalty."""
    cov_kl_coef: float = 1.0
    """beta: weight of the |log r_t| penalty on selected tokens (not the reference-KL kl_coef)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_selection()
        if self.cov_kl_coef < 0.0:
            raise config_error(self, f"cov_kl_coef={self.cov_kl_coef} must be >= 0")

    def surrogate(self, ratio: torch.Tensor, adv: torch.Tensor, context: BoundsContext) -> Surrogate:
        return unclipped_surrogate(ratio, adv)

    def apply_selection(self, terms: LossTerms, selected: torch.Tensor,
                        log_ratio: torch.Tensor) -> LossTerms:
        penalty = self.cov_kl_coef * log_ratio.abs()
        loss = terms.per_token_loss
        return replace(terms, per_token_loss=torch.where(selected, loss + penalty, loss))


def covariance_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    segment_ids: torch.Tensor,
    old_entropy: torch.Tensor,
    config: _CovarianceConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token Clip-Cov / KL-Cov loss (value to minimise; module docstring).

    Args, returns and errors as ``nemo_sspo.algorithms.losses.ratio_clip.ratio_clip_loss``;
    ``config`` is a :class:`ClipCovLossConfig` or :class:`KLCovLossConfig`. Adds the metric
    ``policy/cov_selected_frac`` (selected tokens / valid tokens).
    """
    check_loss_inputs(logprobs, old_logprobs, advantages, response_mask, segment_ids, old_entropy,
                      config, _CovarianceConfig, ref_logprobs=ref_logprobs, entropy=entropy)
    terms = ratio_objective(logprobs, old_logprobs, advantages, response_mask, segment_ids,
                            old_entropy, config)
    selected, _ = select_high_covariance_tokens(
        logprobs, advantages, response_mask, config.select_fraction, cov_min=config.cov_min,
        cov_max=config.cov_max)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(response_mask, logprobs - old_logprobs.detach(), zero)
    terms = config.apply_selection(terms, selected, log_ratio)
    extra = {"policy/cov_selected_frac": pair(selected.sum(), response_mask.sum())}
    terms = replace(terms, extra_metrics={**terms.extra_metrics, **extra})
    return finish_policy_loss(terms, config, logprobs=logprobs, old_entropy=old_entropy,
                              ref_logprobs=ref_logprobs, entropy=entropy)


register_policy_loss("clip_cov", ClipCovLossConfig)(covariance_policy_loss)
register_policy_loss("kl_cov", KLCovLossConfig)(covariance_policy_loss)
