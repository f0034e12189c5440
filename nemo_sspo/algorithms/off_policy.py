"""Off-policy corrections between the behaviour policy mu and the proximal policy pi_old.

Three policies meet in one update once rollouts may be stale or come from another engine: the
behaviour policy mu that sampled the tokens (the rollout engine's log-probs, possibly from older
weights), the proximal policy pi_old (the trainer's recompute at the weights the step starts from)
and pi_theta (being trained). Every loss of the family keeps its own ratio pi_theta / pi_old and
its own clip; the gap mu -> pi_old is corrected by a constant weight w (no gradient) multiplying
each token's loss before aggregation (the decoupled objective of AReaL, arXiv 2505.24298, and the
rollout-correction of Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
RL training"). With the token log-ratio l_t = log pi_old(y_t) - log mu(y_t):

- ``token_tis``:     w_t = min(exp(l_t), C)                          (Yao et al.; slime ``--use-tis``)
- ``sequence_tis``:  w_t = min(exp(sum_t l_t), C) for every token of the response
                     (verl ``rollout_is`` sequence level; TRL ``sequence_truncate``)
- ``segment_tis``:   w_t = min(exp(mean_{t in y_ij} l_t), C) for every token of segment y_ij: the
                     geometric mean of the segment's token ratios, truncated. Ours: it gives the
                     correction the granularity of the loss's own ratio (SSPO's subsentences; with
                     token segments it is ``token_tis``, with whole-response segments the geometric
                     mean over the response).
- ``token_mask``:    w_t = exp(l_t) if low <= exp(l_t) <= high else 0     (IcePop, Ling team's
                     Ring-1T report, arXiv 2510.18855; verl's ``"low_high"`` form, e.g. 0.5_5.0)
- ``sequence_mask``: w_t = exp(sum l) if low <= exp(sum l) <= high else 0 for the response's tokens
                     (TRL ``vllm_importance_sampling_mode="sequence_mask"``, which uses low = 0,
                     high = C = 3)
- ``none``:          no correction (w = 1).

Exponents are bounded before ``exp`` (truncation and masking are decided in log space), so an
extreme log-ratio never overflows float32 (docs/pitfalls.md#p3).
"""

from __future__ import annotations

import math

import torch

from nemo_sspo.algorithms.ratios import segment_mean
from nemo_sspo.choice import Choice
from nemo_sspo.metrics import SQ_CENTRE, MetricPair, mean_pair, mean_sq_pair

__all__ = ["Correction", "TRUNCATING_CORRECTIONS", "MASKING_CORRECTIONS", "effective_sample_size",
           "off_policy_weights"]


class Correction(Choice):
    """Every correction mode (config key ``rollout.correction.name``; module docstring)."""

    none = "none"
    token_tis = "token_tis"
    sequence_tis = "sequence_tis"
    segment_tis = "segment_tis"
    token_mask = "token_mask"
    sequence_mask = "sequence_mask"


TRUNCATING_CORRECTIONS = (Correction.token_tis, Correction.sequence_tis, Correction.segment_tis)
"""Modes that truncate the weight at ``cap``."""
MASKING_CORRECTIONS = (Correction.token_mask, Correction.sequence_mask)
"""Modes that zero the weight outside ``[low, high]``."""

_SEQUENCE_MODES = (Correction.sequence_tis, Correction.sequence_mask)
# k3 needs exp(l) itself (no truncation): bounded in float64, where exp(80) ~ 5.5e34 is finite.
_K3_LOG_RATIO_MAX = 80.0


def _unit_log_ratios(mode: str, log_ratio: torch.Tensor, mask: torch.Tensor,
                     segment_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's correction-unit log-ratio and the unit mask.

    Returns ``[B, T]`` float64 log-ratios of the unit (token, segment or response) broadcast to its
    tokens (0 off the mask), and the unit mask (``[B, T]`` for token units, ``[B, 1]`` for responses).
    """
    if mode in _SEQUENCE_MODES:
        per_row = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(dim=1, keepdim=True)
        return torch.where(mask, per_row, torch.zeros_like(log_ratio)), mask.any(dim=1, keepdim=True)
    if mode == "segment_tis":
        if segment_ids is None:
            raise ValueError("correction='segment_tis' needs segment_ids (the loss's segments)")
        return segment_mean(log_ratio, segment_ids, mask)[0], mask
    return torch.where(mask, log_ratio, torch.zeros_like(log_ratio)), mask


def off_policy_weights(mode: str, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                       mask: torch.Tensor, *, segment_ids: torch.Tensor | None = None, cap: float = 2.0,
                       low: float = 0.5, high: float = 5.0) -> tuple[torch.Tensor, dict[str, MetricPair]]:
    """Per-token correction weights for ``mode`` (module docstring) and their metrics.

    Defaults: ``cap = 2.0`` (slime's ``--use-tis`` C = 2 and verl's ``rollout_is_threshold`` 2.0);
    ``[low, high] = [0.5, 5.0]`` (IcePop's band as verl writes it, ``"0.5_5.0"``). The config's
    ``rollout.correction_*`` fields carry the run's values.

    Args:
        mode: a :class:`Correction` (or its name).
        old_logprobs: ``[B, T]`` float, log pi_old of the sampled tokens (trainer recompute), one
            response per row.
        rollout_logprobs: ``[B, T]`` float, log mu of the same tokens (the engine's, same frame).
        mask: ``[B, T]`` bool, True at response tokens.
        segment_ids: ``[B, T]`` int64 segment of each token within its row (the loss's
            segmentation; -1 off the mask); required by ``segment_tis`` only.
        cap: truncation C >= 1 of the ``*_tis`` modes.
        low: lower bound (>= 0) of the ``*_mask`` modes' band, on the ratio (not its log).
        high: upper bound (> low) of the ``*_mask`` modes' band.

    Returns:
        ``(weights, metrics)``: weights ``[B, T]`` float32, detached, 1.0 off the mask (all ones for
        ``none``); metrics as metric pairs over the mode's units (tokens; responses for the
        ``sequence_*`` modes): ``rollout/is_weight`` (mean weight) with ``rollout/is_weight_sq``
        (mean squared weight: gives ``rollout/is_weight_std`` and, by
        :func:`effective_sample_size`, the ESS), ``rollout/is_truncated_frac`` (``*_tis``: share of
        units whose ratio exceeded C) or ``rollout/is_masked_frac`` (``*_mask``: share of units
        outside the band), and ``rollout/kl_k3_behaviour`` (per token, the k3 estimator
        ``r - 1 - log r`` with ``r = pi_old / mu`` of KL(mu || pi_old), samples from mu;
        Schulman 2020, "Approximating KL divergence"). ``none`` returns no metrics.

    Raises:
        ValueError: an unknown mode, shapes that differ, ``cap < 1``, ``low < 0`` or
            ``low >= high``, or ``segment_tis`` without ``segment_ids``.
    """
    if mode not in tuple(Correction):
        raise ValueError(f"correction={mode!r} is unknown; valid: {', '.join(Correction)}")
    if not old_logprobs.shape == rollout_logprobs.shape == mask.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape")
    if cap < 1:
        raise ValueError(f"cap={cap} must be >= 1 (a cap below 1 shrinks on-policy tokens too)")
    if not 0 <= low < high:
        raise ValueError(f"low={low}, high={high}: the mask band needs 0 <= low < high")
    if mode == "none":
        return torch.ones(mask.shape, dtype=torch.float32, device=mask.device), {}
    log_ratio = old_logprobs.detach().double() - rollout_logprobs.detach().double()
    unit_log, unit_mask = _unit_log_ratios(mode, log_ratio, mask, segment_ids)
    if mode in TRUNCATING_CORRECTIONS:
        outside = unit_log > math.log(cap)
        unit_weight = torch.exp(unit_log.clamp(max=math.log(cap)))
        share_key = "rollout/is_truncated_frac"
    else:
        log_low = math.log(low) if low > 0 else -math.inf
        outside = (unit_log < log_low) | (unit_log > math.log(high))
        unit_weight = torch.where(outside, torch.zeros_like(unit_log), torch.exp(unit_log.clamp(max=math.log(high))))
        share_key = "rollout/is_masked_frac"
    weights = torch.where(mask, unit_weight, torch.ones_like(unit_weight)).float()
    metrics = _weight_metrics(mode, weights, outside, mask, unit_mask, share_key)
    r_log = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).clamp(max=_K3_LOG_RATIO_MAX)
    k3 = torch.expm1(r_log) - r_log
    metrics["rollout/kl_k3_behaviour"] = mean_pair(k3[mask].sum(), mask.sum())
    return weights, metrics


def _weight_metrics(mode: str, weights: torch.Tensor, outside: torch.Tensor, mask: torch.Tensor,
                    unit_mask: torch.Tensor, share_key: str) -> dict[str, MetricPair]:
    """Mean, mean square and out-of-bounds share of the weights over the mode's units."""
    if mode in _SEQUENCE_MODES:  # one unit per response: its first valid token carries it
        first = mask & (mask.cumsum(dim=1) == 1)
        unit_weights, unit_outside = weights[first], outside[first]
    else:
        unit_weights, unit_outside = weights[mask], outside[mask]
    count = unit_mask.sum()
    return {
        "rollout/is_weight": mean_pair(unit_weights.sum(), count),
        "rollout/is_weight_sq": mean_sq_pair((unit_weights.double() - SQ_CENTRE).square().sum(), count),
        share_key: mean_pair(unit_outside.sum(), count),
    }


def effective_sample_size(metrics: dict[str, float]) -> float | None:
    """Normalised effective sample size of the correction weights from reduced metrics.

    ESS / N = (sum w)^2 / (N sum w^2) = mean(w)^2 / mean(w^2) (Kong 1992; 1 when every weight is
    equal, 1/N when one unit carries all the weight).

    Args:
        metrics: reduced step metrics holding ``rollout/is_weight`` and ``rollout/is_weight_sq``
            (:func:`off_policy_weights`).

    Returns:
        ESS / N in (0, 1], 0.0 when every weight is 0, or None when the keys are absent.
    """
    if "rollout/is_weight" not in metrics or "rollout/is_weight_sq" not in metrics:
        return None
    mean_sq = metrics["rollout/is_weight_sq"]
    return metrics["rollout/is_weight"] ** 2 / mean_sq if mean_sq > 0 else 0.0
