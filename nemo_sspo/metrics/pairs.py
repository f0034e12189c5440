"""Metric pairs: what a step metric carries between micro-batches, ranks and the log.

A metric is a :class:`MetricPair` ``(total, count, kind)`` whose kind says how it combines:

- ``"mean"``: ``total`` is a sum over ``count`` items; pairs add, and the value is
  ``total / count`` over every micro-batch and data-parallel rank, never a mean of means
  (docs/pitfalls.md#p10);
- ``"min"`` / ``"max"``: ``total`` is the extreme over ``count`` items; pairs combine with
  MIN / MAX and add their counts, a pair whose count is 0 takes no part (value 0 when nothing
  anywhere is valid);
- ``"mean_sq"``: a ``"mean"`` pair of the squared deviations ``(x - 1)^2`` from :data:`SQ_CENTRE`,
  stored under ``<base>_sq`` next to the ``"mean"`` pair ``<base>`` of ``x``; the summary reports
  ``<base>_sq`` as the mean square ``E[x^2] = E[(x - 1)^2] + 2 E[x] - 1`` and derives
  ``<base>_std = sqrt(max(E[(x - 1)^2] - (E[x] - 1)^2, 0))``.

Totals and counts are float64. The spreads we log are of importance ratios and weights, which sit
near 1: ``sqrt(E[x^2] - E[x]^2)`` from float32 means cancels (a true spread of 1e-6 read as 3e-4),
and even in float64 its error grows with the number of items; about 1 both terms are small and the
difference keeps its digits (the algebra is exact for any values; centring is ours).

:func:`merge_metric_sums` combines micro-batches in one process, :func:`summarize_metric_pairs`
turns pairs into floats; ``nemo_sspo.parallel.metric_reduce.reduce_metric_sums`` does both across
data-parallel ranks and pipeline stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

SQ_CENTRE = 1.0
"""The value ``"mean_sq"`` pairs square their deviations from (module docstring)."""

MetricKind = Literal["mean", "min", "max", "mean_sq"]
METRIC_KINDS: tuple[str, ...] = ("mean", "min", "max", "mean_sq")
_ADDITIVE_KINDS = ("mean", "mean_sq")  # pairs that combine by adding total and count

_F64 = torch.float64


@dataclass(frozen=True)
class MetricPair:
    """One metric of one or more micro-batches (module docstring).

    Attributes:
        total: 0-d float64 tensor: the sum (additive kinds) or the extreme (``"min"``/``"max"``).
        count: 0-d float64 tensor: the number of items; 0 marks an empty pair.
        kind: one of :data:`METRIC_KINDS`.

    Raises:
        ValueError: unknown kind.
    """

    total: torch.Tensor
    count: torch.Tensor
    kind: MetricKind = "mean"

    def __post_init__(self) -> None:
        if self.kind not in METRIC_KINDS:
            raise ValueError(f"unknown metric kind {self.kind!r}; valid: {METRIC_KINDS}")

    @property
    def additive(self) -> bool:
        """Whether pairs of this kind combine by summation (``"mean"``, ``"mean_sq"``)."""
        return self.kind in _ADDITIVE_KINDS

    def as_tensor(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[2]`` tensor ``(total, count)`` of ``dtype`` on the pair's device, detached."""
        return torch.stack([self.total, self.count]).detach().to(dtype)

    def detach(self) -> MetricPair:
        """The same pair without autograd history."""
        return MetricPair(self.total.detach(), self.count.detach(), self.kind)


def _scalar(value: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(value).to(_F64).reshape(())


def mean_pair(total: torch.Tensor | float, count: torch.Tensor | float) -> MetricPair:
    """A ``"mean"`` pair: ``total`` summed over ``count`` items (tensors keep their device)."""
    return MetricPair(_scalar(total), _scalar(count), "mean")


def mean_sq_pair(total: torch.Tensor | float, count: torch.Tensor | float) -> MetricPair:
    """A ``"mean_sq"`` pair: ``total`` = the sum of ``(x - SQ_CENTRE)^2`` over ``count`` items
    (store it under ``<base>_sq``; sum in float64 where the values are close together).
    """
    return MetricPair(_scalar(total), _scalar(count), "mean_sq")


def _extreme(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | None,
             kind: MetricKind) -> MetricPair:
    fill = torch.inf if kind == "min" else -torch.inf
    masked = torch.where(mask, values.to(_F64), torch.full((), fill, dtype=_F64, device=values.device))
    masked = masked.reshape(-1)
    if masked.numel() == 0:  # an empty batch (B = 0 or T = 0): an empty pair, not a reduction error
        masked = masked.new_full((1,), fill)
    extreme = masked.amin() if kind == "min" else masked.amax()
    count = mask.sum() if count is None else count
    count = _scalar(count)
    return MetricPair(torch.where(count > 0, extreme, torch.zeros_like(extreme)), count, kind)


def min_pair(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | None = None) -> MetricPair:
    """A ``"min"`` pair: the smallest of ``values[mask]`` (any shape, ``mask`` bool of the same
    shape), value 0 when nothing is valid.

    ``count`` is the number of items the extreme is over (default: the valid entries), e.g. the
    responses when ``values`` holds one response-level value per token; 0 marks an empty pair.
    """
    return _extreme(values, mask, count, "min")


def max_pair(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | None = None) -> MetricPair:
    """A ``"max"`` pair: the largest of ``values[mask]``; as :func:`min_pair` otherwise."""
    return _extreme(values, mask, count, "max")


def _merge_pair(a: MetricPair, b: MetricPair) -> MetricPair:
    """Two pairs of one metric combined by their kind (an empty extreme pair takes no part)."""
    if a.kind != b.kind:
        raise ValueError(f"cannot merge a {a.kind!r} metric pair with a {b.kind!r} one")
    count = a.count + b.count
    if a.additive:
        return MetricPair(a.total + b.total, count, a.kind)
    both = torch.minimum(a.total, b.total) if a.kind == "min" else torch.maximum(a.total, b.total)
    total = torch.where(a.count > 0, torch.where(b.count > 0, both, a.total), b.total)
    return MetricPair(total, count, a.kind)


def merge_metric_sums(total: dict[str, MetricPair], new: dict[str, MetricPair]) -> dict[str, MetricPair]:
    """Combine one micro-batch's metric pairs into running totals; returns a new dict.

    Keys missing on one side are copied from the other; the inputs are not changed.

    Raises:
        ValueError: a key has different kinds on the two sides.
    """
    out = dict(total)
    for key, value in new.items():
        out[key] = _merge_pair(out[key], value) if key in out else value
    return out


def summarize_metric_pairs(pairs: dict[str, MetricPair]) -> dict[str, float]:
    """Floats from (already reduced) pairs: ``total / count`` for additive kinds, the extreme for
    ``"min"`` / ``"max"``; for each ``"mean_sq"`` pair ``<base>_sq`` whose ``"mean"`` pair ``<base>``
    is present, the mean square ``E[x^2]`` and ``<base>_std`` (module docstring); a pair whose count
    is 0 reports 0.0.

    Raises:
        TypeError: a value is not a :class:`MetricPair`.
        ValueError: a ``"mean_sq"`` key does not end with ``_sq``.
    """
    for key, value in pairs.items():
        if not isinstance(value, MetricPair):
            raise TypeError(f"metric {key!r} must be a MetricPair, got {type(value).__name__}")
    result = {}
    for key, value in sorted(pairs.items()):
        total, count = value.as_tensor(torch.float64).tolist()
        if count <= 0:
            result[key] = 0.0
        else:
            result[key] = float(total / count) if value.additive else float(total)
    for key, value in sorted(pairs.items()):
        if value.kind != "mean_sq":
            continue
        if not key.endswith("_sq"):
            raise ValueError(f"'mean_sq' metric {key!r} must be named '<base>_sq'")
        base = key[: -len("_sq")]
        if base in pairs and pairs[base].kind == "mean":
            centred_sq, shift = result[key], result[base] - SQ_CENTRE
            result[key] = centred_sq + 2 * SQ_CENTRE * result[base] - SQ_CENTRE ** 2
            result[f"{base}_std"] = math.sqrt(max(centred_sq - shift ** 2, 0.0))
    return result
