"""Per-step diagnostics of a policy loss as :class:`nemo_sspo.metrics.MetricPair` s.

Each key's pair kind (``"mean"``, ``"min"``, ``"max"``, ``"mean_sq"``) is set where the pair is
made; :mod:`nemo_sspo.metrics.pairs` says how each kind merges and summarises.

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

Under context parallelism (``cp``) every weight uses the CP-reduced segment and response lengths,
the mean pairs are this rank's share (its own tokens; the response count on CP rank 0 only) and
are summed over the CP group by ``policy_loss_sums``; the ``_min`` / ``_max`` pairs are reduced
here (MIN / MAX over the group, the CP = 1 count), the same on every CP rank (ours).
"""

from __future__ import annotations

import torch

from nemo_sspo.algorithms.cp_context import CPContext, cp_sum, items_on_this_rank
from nemo_sspo.algorithms.kl import kl_estimate
from nemo_sspo.algorithms.ratios import LOG_RATIO_CLAMP, segment_mean
from nemo_sspo.algorithms.segmentation import mask_segment_ids
from nemo_sspo.metrics import SQ_CENTRE, MetricPair, max_pair, mean_pair, mean_sq_pair, min_pair

ENTROPY_BAND_EDGES = (0.2, 0.75, 1.0)
ENTROPY_BAND_KEYS = (
    "policy/segment_entropy_share/lt_0.20",
    "policy/segment_entropy_share/0.20_0.75",
    "policy/segment_entropy_share/0.75_1.00",
    "policy/segment_entropy_share/ge_1.00",
)

_F64 = torch.float64  # values, weights and counts: a weighted mean's total and count are the same float64 sums
_WEIGHTING = {"token": "tokens", "segment": "segments", "response": "responses"}


class _Weights:
    """Per-token weights that count tokens, segments or responses once each."""

    def __init__(self, mask: torch.Tensor, segment_length: torch.Tensor,
                 cp: CPContext | None = None) -> None:
        self.mask, self.cp = mask, cp
        valid = mask.to(_F64)
        lengths = cp_sum(valid.sum(dim=1, keepdim=True), cp)  # the whole row's length
        self.by = {
            "tokens": valid,
            "segments": valid / segment_length.to(_F64).clamp(min=1),
            "responses": valid / lengths.clamp(min=1),
        }
        self.count = {name: w.sum() for name, w in self.by.items()}
        responses = (lengths > 0).sum().to(_F64)
        self.count["responses"] = items_on_this_rank(responses, cp)
        self._group_count: dict[str, torch.Tensor] = {"responses": responses}

    def group_count(self, level: str) -> torch.Tensor:
        """The count of ``level`` over the CP group (this rank's without CP), for extreme pairs."""
        if level not in self._group_count:
            self._group_count[level] = cp_sum(self.count[level], self.cp)
        return self._group_count[level]

    def _masked(self, values: torch.Tensor) -> torch.Tensor:
        # where, not multiply: inf/NaN at masked positions must not reach a sum.
        return torch.where(self.mask, values.to(_F64), torch.zeros((), dtype=_F64, device=values.device))

    def _weighted_sum(self, values: torch.Tensor, level: str) -> torch.Tensor:
        # float64: the spread of values near 1 is taken from these sums (nemo_sspo.metrics.pairs)
        return (self._masked(values) * self.by[level]).sum()

    def mean(self, values: torch.Tensor, level: str) -> MetricPair:
        return mean_pair(self._weighted_sum(values, level), self.count[level])

    def spread(self, key: str, values: torch.Tensor, level: str) -> dict[str, MetricPair]:
        """Mean, mean of squares, min and max of a per-token quantity at one weighting."""
        values, count = self._masked(values), self.count[level]
        return {
            key: self.mean(values, level),
            f"{key}_sq": mean_sq_pair(self._weighted_sum((values - SQ_CENTRE).square(), level), count),
            **self._extremes(key, values, level),
        }

    def _extremes(self, key: str, values: torch.Tensor, level: str) -> dict[str, MetricPair]:
        if self.cp is None:
            count = self.count[level]
            return {f"{key}_min": min_pair(values, self.mask, count),
                    f"{key}_max": max_pair(values, self.mask, count)}
        inf = torch.full((), torch.inf, dtype=_F64, device=values.device)
        low = torch.where(self.mask, values, inf).reshape(-1)
        high = torch.where(self.mask, values, -inf).reshape(-1)
        local = torch.stack([torch.cat([low, inf[None]]).amin(), -torch.cat([high, -inf[None]]).amax()])
        low, high = self.cp.min(local).unbind(0)  # one collective for both extremes
        count = self.group_count(level)
        zero = torch.zeros_like(low)
        return {f"{key}_min": MetricPair(torch.where(count > 0, low, zero), count, "min"),
                f"{key}_max": MetricPair(torch.where(count > 0, -high, zero), count, "max")}


def _raw_ratios(terms, cp: CPContext | None) -> dict[str, torch.Tensor]:
    """The exp of the mean token log-ratio over each token, loss segment and response."""
    mask, log_ratio = terms.response_mask, terms.log_ratio
    whole = mask_segment_ids("response", mask)
    segment_log, _ = segment_mean(log_ratio, terms.segments, mask, cp=cp)
    response_log, _ = segment_mean(log_ratio, whole, mask, cp=cp)
    return {
        level: torch.exp(value.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        for level, value in (("token", log_ratio), ("segment", segment_log),
                             ("response", response_log))
    }


def _entropy_bands(weights: _Weights, segment_entropy: torch.Tensor) -> dict[str, MetricPair]:
    edges = (-torch.inf, *ENTROPY_BAND_EDGES, torch.inf)
    out = {}
    for key, low, high in zip(ENTROPY_BAND_KEYS, edges[:-1], edges[1:], strict=True):
        inside = (segment_entropy >= low) & (segment_entropy < high)
        out[key] = weights.mean(inside, "segments")
    return out


@torch.no_grad()
def policy_metrics(terms, old_entropy: torch.Tensor | None, *,
                   cp: CPContext | None = None) -> dict[str, MetricPair]:
    """All keys of the module docstring from a loss's ``LossTerms``, as detached pairs.
    Without ``old_entropy`` (``[B, T]`` or None) the entropy keys and bands are left out.
    ``cp``: context parallelism (module docstring); ``terms.segment_length`` must then be the
    CP-reduced one.

    Raises:
        ValueError: ``terms.extra_metrics`` reuses a key computed here.
    """
    mask = terms.response_mask
    weights = _Weights(mask, terms.segment_length, cp)
    flags = {"low": terms.clip_low, "high": terms.clip_high, "dual": terms.clip_dual}
    clipped = (terms.clip_low | terms.clip_high | terms.clip_dual) & mask
    metrics: dict[str, MetricPair] = {}
    for level in ("tokens", "segments", "responses"):
        metrics[f"policy/clipfrac_{level}"] = weights.mean(clipped, level)
        for side, flag in flags.items():
            metrics[f"policy/clipfrac_{side}_{level}"] = weights.mean(flag & mask, level)
    metrics["policy/zero_grad_frac_tokens"] = weights.mean(terms.grad_zero & mask, "tokens")
    metrics["policy/ratio"] = weights.mean(terms.ratio, "segments")
    for level, ratio in _raw_ratios(terms, cp).items():
        metrics.update(weights.spread(f"policy/ratio_{level}", ratio, _WEIGHTING[level]))
    for estimator in ("k1", "k3"):
        kl = kl_estimate(terms.log_ratio, estimator)  # KL(pi_old || pi_theta), samples of pi_old
        metrics[f"policy/approx_kl_{estimator}"] = weights.mean(kl, "tokens")
    metrics["policy/segments_per_response"] = mean_pair(weights.count["segments"],
                                                        weights.count["responses"])
    if old_entropy is not None:
        metrics["policy/entropy"] = weights.mean(old_entropy, "tokens")
        metrics.update(_entropy_bands(weights, terms.segment_entropy))
    if terms.b_low is not None:
        metrics["policy/b_low"] = weights.mean(terms.b_low, "segments")
        metrics["policy/b_high"] = weights.mean(terms.b_high, "segments")
    if terms.gate_weight is not None:
        metrics["policy/gate_weight"] = weights.mean(terms.gate_weight, "tokens")
    taken = sorted(set(terms.extra_metrics) & set(metrics))
    if taken:
        raise ValueError(f"LossTerms.extra_metrics keys {taken} are shared metrics of every loss; "
                         "give the loss's own metrics other names (e.g. policy/<loss>_<what>)")
    metrics.update(terms.extra_metrics)
    return metrics

