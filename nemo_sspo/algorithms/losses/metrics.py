"""Per-step diagnostics of a policy loss as float32 ``[2]`` tensors ``(sum, count)``.

Pair kinds, by key suffix (:func:`metric_kind`):

- default ``(sum, count)``: the value is ``sum / count`` over every micro-batch and data-parallel
  rank, never a mean of means (docs/pitfalls.md, P10);
- ``_min`` / ``_max``: ``(extreme value, count)``, combined with MIN / MAX; a pair whose count is 0
  takes no part (value 0 when nothing anywhere is valid);
- derived: a key ``K_sq`` next to ``K`` is a mean of squares, from which the summary derives
  ``K_std = sqrt(max(K_sq - K^2, 0))``.

:func:`merge_metric_sums` combines micro-batches, :func:`summarize_metric_pairs` turns pairs into
floats in one process, and ``nemo_sspo.parallel.metrics.reduce_metric_sums`` does both across
data-parallel ranks and pipeline stages.

Weightings: ``_tokens`` counts every valid token once; ``_segments`` every segment of the loss's
ratio once (a token weighs 1/|segment|); ``_responses`` every non-empty response once (a token
weighs 1/|response|).

Keys (every loss): ``policy/clipfrac_{tokens,segments,responses}`` (any clip) and
``policy/clipfrac_{low,high,dual}_{tokens,segments,responses}``; ``policy/zero_grad_frac_tokens``;
``policy/ratio`` (the ratio the loss applies, per segment) and the raw ratios
``policy/ratio_{token,segment,response}`` with ``_sq``, ``_min``, ``_max`` (exp of the mean token
log-ratio over the token / the loss's segment / the whole response); ``policy/approx_kl_k1`` and
``policy/approx_kl_k3`` (KL(pi_old || pi_theta) per token); ``policy/entropy`` (old-policy token
entropy); ``policy/segments_per_response``; the share of segments per entropy band
(:data:`ENTROPY_BAND_KEYS`). Loss-dependent: ``policy/b_low``, ``policy/b_high`` (mean bounds per
segment), ``policy/gate_weight`` (soft gates), plus each loss's extra keys.

Entropy bands (segment entropy H_ij, eq. 13, in nats) follow the regions of SSPO eqs. 14-15 at the
paper's 1.5B setting (alpha 0, beta 0.8, gamma 1.75): H < 0.2 (b_low held at beta), 0.2 <= H < 0.75
(both bounds move with H), 0.75 <= H < 1 (b_high saturated at gamma), H >= 1 (b_low = 0: no lower
clip). The edges are fixed for every loss so that runs compare.
"""

from __future__ import annotations

import math

import torch

from nemo_sspo.algorithms.kl import kl_estimate
from nemo_sspo.algorithms.ratios import LOG_RATIO_CLAMP, segment_mean
from nemo_sspo.algorithms.segmentation import segment_ids_for_level

ENTROPY_BAND_EDGES = (0.2, 0.75, 1.0)
ENTROPY_BAND_KEYS = (
    "policy/segment_entropy_share/lt_0.20",
    "policy/segment_entropy_share/0.20_0.75",
    "policy/segment_entropy_share/0.75_1.00",
    "policy/segment_entropy_share/ge_1.00",
)

_F32 = torch.float32
_WEIGHTING = {"token": "tokens", "segment": "segments", "response": "responses"}


def metric_kind(key: str) -> str:
    """``"min"``, ``"max"`` or ``"sum"`` from the key's suffix (module docstring)."""
    if key.endswith("_min"):
        return "min"
    if key.endswith("_max"):
        return "max"
    return "sum"


def _merge_pair(key: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    kind = metric_kind(key)
    if kind == "sum":
        return a + b
    both = torch.minimum(a[0], b[0]) if kind == "min" else torch.maximum(a[0], b[0])
    value = torch.where(a[1] > 0, torch.where(b[1] > 0, both, a[0]), b[0])
    return torch.stack([value, a[1] + b[1]])


def merge_metric_sums(total: dict[str, torch.Tensor],
                      new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Combine one micro-batch's metric pairs into running totals; returns a new dict.

    Plain pairs add; ``_min`` / ``_max`` pairs keep the extreme of the non-empty ones and add the
    counts. Use it wherever pairs of several micro-batches or mini-batches are accumulated (adding
    min/max pairs would be wrong). Keys missing on one side are copied from the other.
    """
    out = dict(total)
    for key, value in new.items():
        out[key] = _merge_pair(key, out[key], value) if key in out else value.clone()
    return out


def summarize_metric_pairs(pairs: dict[str, torch.Tensor]) -> dict[str, float]:
    """Floats from (already reduced) pairs: ``sum / count`` for plain pairs, the extreme for
    ``_min`` / ``_max``, plus the derived ``_std`` keys; a pair whose count is 0 reports 0.0.

    Args:
        pairs: name -> ``[2]`` tensor (any float dtype, any device).

    Raises:
        ValueError: a value is not a ``[2]`` tensor.
    """
    result = {}
    for key, value in sorted(pairs.items()):
        if value.shape != (2,):
            raise ValueError(f"metric {key!r} must be a (sum, count) tensor of shape [2], got "
                             f"{tuple(value.shape)}")
        total, count = value.detach().to("cpu", torch.float64).tolist()
        if count <= 0:
            result[key] = 0.0
        else:
            result[key] = float(total / count) if metric_kind(key) == "sum" else float(total)
    for key in list(result):
        base = key[: -len("_sq")]
        if key.endswith("_sq") and base in result and metric_kind(base) == "sum":
            result[f"{base}_std"] = math.sqrt(max(result[key] - result[base] ** 2, 0.0))
    return result


def pair(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``torch.stack([total, count])`` as float32 ``[2]``."""
    return torch.stack([total.to(_F32), count.to(_F32)])


def extreme_pair(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor,
                 *, largest: bool) -> torch.Tensor:
    """``(max or min of values[mask], count)``; value 0 when nothing is valid."""
    fill = -torch.inf if largest else torch.inf
    masked = torch.where(mask, values.to(_F32), torch.full((), fill, dtype=_F32,
                                                          device=values.device))
    extreme = masked.amax() if largest else masked.amin()
    extreme = torch.where(count > 0, extreme, torch.zeros_like(extreme))
    return pair(extreme, count)


class _Weights:
    """Per-token weights that count tokens, segments or responses once each."""

    def __init__(self, mask: torch.Tensor, segment_length: torch.Tensor) -> None:
        self.mask = mask
        valid = mask.to(_F32)
        lengths = valid.sum(dim=1, keepdim=True)
        self.by = {
            "tokens": valid,
            "segments": valid / segment_length.to(_F32).clamp(min=1),
            "responses": valid / lengths.clamp(min=1),
        }
        self.count = {name: w.sum() for name, w in self.by.items()}
        self.count["responses"] = (lengths > 0).sum().to(_F32)

    def _masked(self, values: torch.Tensor) -> torch.Tensor:
        # where, not multiply: inf/NaN at masked positions must not reach a sum.
        return torch.where(self.mask, values.to(_F32), torch.zeros((), dtype=_F32,
                                                                   device=values.device))

    def mean(self, values: torch.Tensor, level: str) -> torch.Tensor:
        return pair((self._masked(values) * self.by[level]).sum(), self.count[level])

    def spread(self, key: str, values: torch.Tensor, level: str) -> dict[str, torch.Tensor]:
        """Mean, mean of squares, min and max of a per-token quantity at one weighting."""
        values = self._masked(values)
        count = self.count[level]
        return {
            key: self.mean(values, level),
            f"{key}_sq": self.mean(values.square(), level),
            f"{key}_min": extreme_pair(values, self.mask, count, largest=False),
            f"{key}_max": extreme_pair(values, self.mask, count, largest=True),
        }


def _raw_ratios(terms) -> dict[str, torch.Tensor]:
    """exp of the mean token log-ratio over each token, loss segment and response."""
    mask, log_ratio = terms.response_mask, terms.log_ratio
    whole = segment_ids_for_level("sequence", mask)
    segment_log, _ = segment_mean(log_ratio, terms.segments, mask)
    response_log, _ = segment_mean(log_ratio, whole, mask)
    return {
        level: torch.exp(value.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        for level, value in (("token", log_ratio), ("segment", segment_log),
                             ("response", response_log))
    }


def _entropy_bands(weights: _Weights, segment_entropy: torch.Tensor) -> dict[str, torch.Tensor]:
    edges = (-torch.inf, *ENTROPY_BAND_EDGES, torch.inf)
    out = {}
    for key, low, high in zip(ENTROPY_BAND_KEYS, edges[:-1], edges[1:]):
        inside = (segment_entropy >= low) & (segment_entropy < high)
        out[key] = weights.mean(inside, "segments")
    return out


@torch.no_grad()
def policy_metrics(terms, old_entropy: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """All keys of the module docstring from a loss's ``LossTerms``; detached float32 ``[2]``.
    Without ``old_entropy`` (``[B, T]`` or None) the entropy keys and bands are left out."""
    mask = terms.response_mask
    weights = _Weights(mask, terms.segment_length)
    flags = {"low": terms.clip_low, "high": terms.clip_high, "dual": terms.clip_dual}
    clipped = (terms.clip_low | terms.clip_high | terms.clip_dual) & mask
    metrics: dict[str, torch.Tensor] = {}
    for level in ("tokens", "segments", "responses"):
        metrics[f"policy/clipfrac_{level}"] = weights.mean(clipped, level)
        for side, flag in flags.items():
            metrics[f"policy/clipfrac_{side}_{level}"] = weights.mean(flag & mask, level)
    metrics["policy/zero_grad_frac_tokens"] = weights.mean(terms.grad_zero & mask, "tokens")
    metrics["policy/ratio"] = weights.mean(terms.ratio, "segments")
    for level, ratio in _raw_ratios(terms).items():
        metrics.update(weights.spread(f"policy/ratio_{level}", ratio, _WEIGHTING[level]))
    for estimator in ("k1", "k3"):
        kl = kl_estimate(terms.log_ratio, estimator)  # KL(pi_old || pi_theta), samples of pi_old
        metrics[f"policy/approx_kl_{estimator}"] = weights.mean(kl, "tokens")
    metrics["policy/segments_per_response"] = pair(weights.count["segments"],
                                                   weights.count["responses"])
    if old_entropy is not None:
        metrics["policy/entropy"] = weights.mean(old_entropy, "tokens")
        metrics.update(_entropy_bands(weights, terms.segment_entropy))
    if terms.b_low is not None:
        metrics["policy/b_low"] = weights.mean(terms.b_low, "segments")
        metrics["policy/b_high"] = weights.mean(terms.b_high, "segments")
    if terms.gate_weight is not None:
        metrics["policy/gate_weight"] = weights.mean(terms.gate_weight, "tokens")
    metrics.update(terms.extra_metrics)
    return metrics

