"""Clip-Cov and KL-Cov (arXiv 2505.22617, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", section 4; official code PRIME-RL/Entropy-Mechanism-of-RL,
verl/trainer/ppo/core_algos.py and recipe/dapo/7b_clip_cov.sh, 7b_kl_cov.sh): restrict the update
of the few tokens whose log-prob covaries most with their advantage, the tokens that drive entropy
collapse.

Token covariance over the N valid tokens of the batch the loss sees (all means over those tokens):

    Cov_t = ( log pi_theta(y_t) - mean log pi_theta ) * ( A_t - mean A )      (no gradient)

- ``clip_cov`` (``compute_policy_loss_clip_cov``): GRPO's clipped token objective; the candidates
  are the tokens the clip has not already cut with cov_min < Cov_t < cov_max (strict); max(1,
  floor(r N)) of them are drawn uniformly at random and their loss is set to 0 (value and
  gradient). The recipe's values: r = 2e-4, band (1, 5), clip 1 -/+ 1 (clip_ratio_low = high = 1,
  so the ratio is only clipped above 2 for A > 0; the recipe's clip_ratio_c = 10 is not read by
  that loss). The draw is ours in one respect: the official code draws from the global torch
  generator, we draw from a generator seeded with ``selection_seed`` on the CPU, so the pick is
  the same on every device and rank for the same micro-batch (module note below).
- ``kl_cov`` (``compute_policy_loss_kl_cov``): unclipped token objective r_t A_t; the max(1,
  floor(k N)) highest-covariance tokens (no band) get the penalty beta |log r_t| on top, the
  official estimate of the token's KL; recipe k = 2e-3 (k_percent 0.2 %), beta = 1 (ppo_kl_coef).

Selection is local to the batch passed to the loss (one micro-batch), not global over the step;
``policy/cov_selected_frac`` reports the selected share so this is visible. The quota is at
least one token when fraction > 0 and the micro-batch has a valid token (the official code's
max(1, ...)); fraction = 0 selects nothing. Clip-Cov's random keys are drawn afresh per call from
the same seed, so a position's priority is the same in every call with the same [B, T] shape;
which tokens are eligible changes from step to step.

Under context parallelism (``LossInputs.context_parallel``) the batch is still the whole
micro-batch: the means and N are reduced over the CP group, Clip-Cov's keys are those of the
unsplit ``[B, S]`` at each rank's positions, and the top-quota choice is made over the group
(:func:`nemo_sspo.algorithms.cp_context.select_top`), so the same tokens are selected as
with CP = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from nemo_sspo.algorithms.cp_context import CPContext, select_top
from nemo_sspo.algorithms.losses.base import LossTerms, PolicyLossConfig, check_eps, config_error
from nemo_sspo.algorithms.losses.inputs import LossInputs
from nemo_sspo.algorithms.losses.ratio_clip import (
    FixedBounds,
    HardClip,
    RatioEngine,
    check_dual_clip,
    unclipped,
)
from nemo_sspo.algorithms.losses.loss_registry import LossRecord, register_policy_loss
from nemo_sspo.metrics import mean_pair


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor,
                     response_mask: torch.Tensor, *, cp: CPContext | None = None) -> torch.Tensor:
    """Cov_t = (log pi(y_t) - mean log pi)(A_t - mean A) over the valid tokens (module docstring).

    Args:
        logprobs: ``[B, T]`` float, log pi_theta of the sampled tokens (read without gradient).
        advantages: ``[B]`` float, one advantage per response.
        response_mask: ``[B, T]`` bool.
        cp: context parallelism: the means are over the whole micro-batch (one all-reduce of
            the count and the two sums), or None.

    Returns:
        ``[B, T]`` float (at least float32), 0 at masked positions.
    """
    mask = response_mask
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    valid = mask.to(dtype)
    lp = torch.where(mask, logprobs.detach().to(dtype), zero)
    adv = torch.where(mask, advantages.detach().to(dtype).unsqueeze(1).expand_as(lp), zero)
    totals = torch.stack([valid.sum(), lp.sum(), adv.sum()])
    if cp is not None:
        totals = cp.sum(totals)
    count, lp_sum, adv_sum = totals.unbind(0)
    count = count.clamp(min=1)
    return (lp - lp_sum / count) * (adv - adv_sum / count) * valid


def _quota(fraction: float, response_mask: torch.Tensor, cp: CPContext | None) -> torch.Tensor:
    """max(1, floor(fraction N)) for fraction > 0 (else floor(fraction N) = 0), as a 0-d tensor;
    N = the valid tokens of the whole micro-batch (over the CP group).
    """
    tokens = response_mask.sum()
    quota = torch.floor(fraction * (tokens if cp is None else cp.sum(tokens)))
    if fraction > 0:  # at least one token, else small micro-batches never select (floor -> 0)
        quota = quota.clamp(min=1.0)
    return quota


def _pick_highest(key: torch.Tensor, eligible: torch.Tensor, quota: torch.Tensor,
                  fraction: float, cp: CPContext | None):
    """``[B, T]`` bool: the ``quota`` eligible positions with the highest ``key`` (fewer if fewer are
    eligible). Ties keep the earlier position (row-major). No host synchronisation. Under CP the
    choice is over the unsplit micro-batch (``select_top``).
    """
    if cp is not None:
        rows = key.shape[0]
        return select_top(key, eligible, quota, cp=cp,
                          max_quota=max(1, math.floor(fraction * rows * cp.width)) + 1)  # + 1: rounding
    flat = torch.where(eligible, key, torch.full_like(key, -math.inf)).reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return (rank.reshape(key.shape) < quota) & eligible


def select_high_covariance_tokens(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    fraction: float,
    *,
    cov_min: float = -math.inf,
    cov_max: float = math.inf,
    cp: CPContext | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-Cov's rule: the max(1, floor(fraction N)) highest-covariance valid tokens with
    cov_min < Cov_t < cov_max (strict; the default band admits every token).

    The quota is at least one token whenever ``fraction > 0`` and the micro-batch has a valid
    token (N >= 1): with the papers' fractions (2e-4, 2e-3) floor(fraction * N) is 0 for any
    micro-batch under 500-5000 tokens, which would silently turn KL-Cov into the unclipped
    objective. ``fraction = 0`` selects nothing. Only eligible tokens are selected, so fewer than
    the quota may be.

    Args:
        logprobs: ``[B, T]`` float, log pi_theta of the sampled tokens (read without gradient).
        advantages: ``[B]`` float, one advantage per response.
        response_mask: ``[B, T]`` bool.
        fraction: share of the N valid tokens to select, in [0, 1].
        cov_min: lower edge of the open eligibility band of Cov_t.
        cov_max: upper edge of the open eligibility band of Cov_t.
        cp: context parallelism (module docstring), or None.

    Returns:
        ``(selected [B, T] bool, covariance [B, T] float)``; covariance is 0 at masked positions.
        Ties keep the earlier position (row-major). No host synchronisation.
    """
    covariance = token_covariance(logprobs, advantages, response_mask, cp=cp)
    eligible = response_mask & (covariance > cov_min) & (covariance < cov_max)
    selected = _pick_highest(covariance, eligible, _quota(fraction, response_mask, cp), fraction, cp)
    return selected, covariance


def select_random_covariance_tokens(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    fraction: float,
    *,
    cov_min: float,
    cov_max: float,
    exclude: torch.Tensor,
    seed: int,
    cp: CPContext | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip-Cov's rule: max(1, floor(fraction N)) tokens drawn uniformly without replacement among
    the valid tokens not in ``exclude`` with cov_min < Cov_t < cov_max (strict).

    The draw gives every position a key from ``torch.rand`` with a CPU generator seeded with
    ``seed`` (row-major over ``[B, T]``) and takes the eligible positions with the highest keys, so
    the result depends only on the inputs and the seed, not on the device.

    Args:
        logprobs: ``[B, T]`` float, log pi_theta of the sampled tokens (read without gradient).
        advantages: ``[B]`` float, one advantage per response.
        response_mask: ``[B, T]`` bool.
        fraction: share of the N valid tokens to select, in [0, 1].
        cov_min: lower edge of the open eligibility band of Cov_t.
        cov_max: upper edge of the open eligibility band of Cov_t.
        exclude: ``[B, T]`` bool, tokens that may not be selected (those the clip already cut).
        seed: seed of the key generator.
        cp: context parallelism (module docstring): the keys are drawn for the unsplit
            ``[B, S]`` and read at this rank's positions; or None.

    Returns:
        ``(selected [B, T] bool, covariance [B, T] float)`` as
        :func:`select_high_covariance_tokens`.
    """
    covariance = token_covariance(logprobs, advantages, response_mask, cp=cp)
    eligible = response_mask & ~exclude & (covariance > cov_min) & (covariance < cov_max)
    generator = torch.Generator().manual_seed(seed)
    rows, width = covariance.shape
    keys = torch.rand((rows, width if cp is None else cp.width), generator=generator,
                      dtype=torch.float64)
    if cp is not None:
        keys = keys[:, cp.positions.cpu()]
    selected = _pick_highest(keys.to(covariance.device), eligible,
                             _quota(fraction, response_mask, cp), fraction, cp)
    return selected, covariance


def _check_fraction(config) -> None:
    if not 0.0 <= config.select_fraction <= 1.0:
        raise config_error(config, f"select_fraction={config.select_fraction} must lie in [0, 1]")


@dataclass
class ClipCovLossConfig(PolicyLossConfig):
    """Clip-Cov (arXiv 2505.22617; code PRIME-RL/Entropy-Mechanism-of-RL): GRPO objective, loss set
    to 0 on randomly drawn high-covariance tokens the clip has not cut (module docstring).
    """

    eps_low: float = 1.0
    """Lower clip 1 - eps_low (recipe clip_ratio_low = 1: lower bound 0, never binds)."""
    eps_high: float = 1.0
    """Upper clip 1 + eps_high (recipe clip_ratio_high = 1: ratio clipped above 2)."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 for A < 0 tokens (the recipe's clip_ratio_c is not read by
    Clip-Cov's loss); None disables."""
    aggregation: str = "token-mean"
    """The recipe's loss_agg_mode."""
    select_fraction: float = 2e-4
    """r: share of tokens whose loss is zeroed (recipe clip_cov_ratio)."""
    cov_min: float = 1.0
    """Lower edge of the open eligibility band (recipe clip_cov_lb); Cov_t == cov_min is out."""
    cov_max: float = 5.0
    """Upper edge of the open eligibility band (recipe clip_cov_ub); Cov_t == cov_max is out."""
    selection_seed: int = 0
    """Seed of the random draw among eligible tokens (ours; the official code is unseeded)."""

    def __post_init__(self) -> None:
        """Check the shared fields, the clip, the fraction and the covariance band."""
        super().__post_init__()
        check_eps(self, "eps_low", "eps_high")
        check_dual_clip(self)
        _check_fraction(self)
        if self.cov_min >= self.cov_max:
            raise config_error(self, f"cov_min={self.cov_min} >= cov_max={self.cov_max}: the open "
                                     "band (cov_min, cov_max) is empty")


@dataclass
class KLCovLossConfig(PolicyLossConfig):
    """KL-Cov (arXiv 2505.22617; code PRIME-RL/Entropy-Mechanism-of-RL): unclipped objective plus
    the |log r| penalty on the highest-covariance tokens.
    """

    aggregation: str = "token-mean"
    """The recipe's loss_agg_mode."""
    select_fraction: float = 2e-3
    """k: share of tokens that get the penalty (recipe k_percent = 0.2, i.e. 0.2 %)."""
    cov_kl_coef: float = 1.0
    """beta: weight of the |log r_t| penalty on selected tokens (recipe ppo_kl_coef = 1; not the
    reference-KL kl_coef)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fraction(self)
        if self.cov_kl_coef < 0.0:
            raise config_error(self, f"cov_kl_coef={self.cov_kl_coef} must be >= 0")


@dataclass(frozen=True)
class ClipCovSelection:
    """Clip-Cov: zero the loss (value and gradient) of randomly drawn eligible tokens."""

    config: ClipCovLossConfig

    def __call__(self, inputs: LossInputs, terms: LossTerms) -> tuple[LossTerms, torch.Tensor]:
        """The terms with the drawn tokens' loss set to 0, and the ``[B, T]`` selection."""
        c = self.config
        selected, _ = select_random_covariance_tokens(
            inputs.logprobs, inputs.advantages, inputs.response_mask, c.select_fraction,
            cov_min=c.cov_min, cov_max=c.cov_max, exclude=terms.grad_zero, seed=c.selection_seed,
            cp=inputs.context_parallel)
        loss = terms.per_token_loss
        # The official loss multiplies by 0: value and gradient both vanish.
        return replace(terms, per_token_loss=torch.where(selected, torch.zeros_like(loss), loss),
                       grad_zero=terms.grad_zero | selected), selected


@dataclass(frozen=True)
class KLCovSelection:
    """KL-Cov: add beta |log r_t| to the highest-covariance tokens."""

    config: KLCovLossConfig

    def __call__(self, inputs: LossInputs, terms: LossTerms) -> tuple[LossTerms, torch.Tensor]:
        """The terms with beta |log r| added at the selected tokens, and the ``[B, T]`` selection."""
        selected, _ = select_high_covariance_tokens(inputs.logprobs, inputs.advantages,
                                                    inputs.response_mask,
                                                    self.config.select_fraction,
                                                    cp=inputs.context_parallel)
        mask, logprobs = inputs.response_mask, inputs.logprobs
        log_ratio = torch.where(mask, logprobs - inputs.old_logprobs.detach(),
                                torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
        loss = terms.per_token_loss
        penalty = self.config.cov_kl_coef * log_ratio.abs()
        return replace(terms, per_token_loss=torch.where(selected, loss + penalty, loss)), selected


class TokenSelection(Protocol):
    """A covariance rule applied to the engine's terms: ``selection(inputs, terms)`` returns the
    changed terms and the ``[B, T]`` bool mask of selected tokens.
    """

    def __call__(self, inputs: LossInputs, terms: LossTerms) -> tuple[LossTerms, torch.Tensor]:
        """The terms with the rule applied, and which tokens it selected."""
        ...


@dataclass(frozen=True)
class CovarianceObjective:
    """The engine's objective with a covariance selection applied on top; adds the metric
    ``policy/cov_selected_frac`` (selected tokens / valid tokens).
    """

    engine: RatioEngine
    selection: TokenSelection

    def __call__(self, inputs: LossInputs, segments: torch.Tensor) -> LossTerms:
        """The engine's terms after the selection, with ``policy/cov_selected_frac``."""
        terms, selected = self.selection(inputs, self.engine(inputs, segments))
        extra = {"policy/cov_selected_frac": mean_pair(selected.sum(), inputs.response_mask.sum())}
        return replace(terms, extra_metrics={**terms.extra_metrics, **extra})


register_policy_loss(LossRecord(
    "clip_cov", ClipCovLossConfig,
    lambda c: CovarianceObjective(
        RatioEngine(HardClip(FixedBounds(c.eps_low, c.eps_high), c.dual_clip_c)),
        ClipCovSelection(c)),
    unit="token"))
register_policy_loss(LossRecord(
    "kl_cov", KLCovLossConfig,
    lambda c: CovarianceObjective(RatioEngine(unclipped), KLCovSelection(c)), unit="token"))
