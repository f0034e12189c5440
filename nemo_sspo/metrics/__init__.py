"""Metric pairs with explicit kinds, the bottom layer every metric producer and consumer shares
(pure torch, no process groups): :class:`MetricPair` and its constructors, merging over
micro-batches and summarising into floats (:mod:`nemo_sspo.metrics.pairs`).

Where the other metric modules sit: ``nemo_sspo.algorithms.losses.metrics`` computes a policy
loss's diagnostics, ``nemo_sspo.parallel.metric_reduce`` reduces pairs over data-parallel ranks and
pipeline stages, ``nemo_sspo.trainer.rollout_metrics`` computes a rollout's metrics and
``nemo_sspo.trainer.metric_log`` writes the reduced floats (console, jsonl, TensorBoard, plot).
"""

from nemo_sspo.metrics.pairs import (
    SQ_CENTRE,
    MetricPair,
    max_pair,
    mean_pair,
    mean_sq_pair,
    merge_metric_sums,
    min_pair,
    summarize_metric_pairs,
)

__all__ = [
    "SQ_CENTRE",
    "MetricPair",
    "max_pair",
    "mean_pair",
    "mean_sq_pair",
    "merge_metric_sums",
    "min_pair",
    "summarize_metric_pairs",
]
