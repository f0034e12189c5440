"""One path from a policy loss to the step's objective: call, weight, aggregate, report.

:func:`policy_loss_sums` is what every host runs per micro-batch (the Megatron trainer, the NeMo-RL
and NeMo-Aligner adapters): it returns the micro-batch's ``(numerator, denominator)`` share of the
step loss under the loss's own aggregation mode, so that ``sum(numerators) / sum(denominators)``
over all micro-batches and data-parallel ranks is the global mean (docs/pitfalls.md#p10).
Under context parallelism (``LossInputs.context_parallel``) the pair is this CP rank's share, so
that the sum over the data- and context-parallel ranks is the same global mean
(:mod:`nemo_sspo.algorithms.aggregation`); the metrics are reduced over the CP group here.
:func:`compute_policy_loss` is the one call for plain tensors in one process.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_sspo.algorithms.aggregation import aggregate
from nemo_sspo.algorithms.cp_context import CPContext
from nemo_sspo.algorithms.losses.inputs import LossInputs, PolicyLoss
from nemo_sspo.algorithms.losses.loss_registry import build_policy_loss_config, make_policy_loss
from nemo_sspo.metrics import MetricPair, mean_pair, summarize_metric_pairs

__all__ = ["compute_policy_loss", "policy_loss_sums"]


def policy_loss_sums(loss: PolicyLoss, inputs: LossInputs, *, max_response_length: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, MetricPair]]:
    """This micro-batch's share of the step loss, and its metric pairs.

    The per-token loss is multiplied by ``inputs.token_weights`` (when given) and reduced with
    ``loss.config.aggregation`` (:func:`nemo_sspo.algorithms.aggregate`).

    Args:
        loss: a bound policy loss (:func:`nemo_sspo.algorithms.losses.make_policy_loss`).
        inputs: the micro-batch.
        max_response_length: L_max in tokens, read by the "constant-denominator" mode only.

    Returns:
        ``(numerator, denominator, metrics)``: 0-d tensors (numerator differentiable; denominator
        a count of tokens for "token-mean", of non-empty responses otherwise) and the loss's
        detached metric pairs plus ``loss/policy`` = ``(numerator, denominator)``. Under context
        parallelism numerator and denominator are this CP rank's shares (their sums over the CP
        group are the CP = 1 values; the numerator's gradient at this rank's tokens is the CP = 1
        gradient of that sum), and the metric pairs are already reduced over the CP group: every
        CP rank holds the CP = 1 pairs, so a host reduces them over data parallelism only.

    Raises:
        ValueError: the loss's own checks, or ``max_response_length`` missing for
            "constant-denominator".
    """
    out = loss(inputs)
    per_token = out.per_token_loss
    if inputs.token_weights is not None:
        per_token = per_token * inputs.token_weights.to(per_token.dtype)
    cp = inputs.context_parallel
    numerator, denominator = aggregate(per_token, inputs.response_mask, loss.config.aggregation,
                                       max_response_length=max_response_length, cp=cp)
    metrics = {key: value.detach() for key, value in out.metrics.items()}
    metrics["loss/policy"] = mean_pair(numerator.detach(), denominator)
    if cp is not None:
        metrics = _sum_additive_pairs(metrics, cp)
    return numerator, denominator, metrics


def _sum_additive_pairs(metrics: dict[str, MetricPair], cp: CPContext) -> dict[str, MetricPair]:
    """The additive pairs summed over the CP group (one all-reduce); the extreme pairs are
    reduced where they are made (``nemo_sspo.algorithms.losses.metrics``).
    """
    keys = sorted(key for key, pair in metrics.items() if pair.additive)
    if not keys:
        return metrics
    summed = cp.sum(torch.stack([metrics[key].as_tensor(torch.float64) for key in keys]))
    out = dict(metrics)
    for key, (total, count) in zip(keys, summed.to(torch.float32), strict=True):
        out[key] = MetricPair(total, count, metrics[key].kind)
    return out


def compute_policy_loss(name: str, inputs: LossInputs, *, max_response_length: int | None = None,
                        **params: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """The registered loss ``name`` on plain tensors, in one process: ``(loss, metrics)``.

    Example (GRPO, defaults but the clip)::

        loss, metrics = compute_policy_loss("grpo", LossInputs(logprobs, old_logprobs,
                                            advantages, response_mask), eps_high=0.28)
        loss.backward()

    Args:
        name: a name of :func:`nemo_sspo.algorithms.losses.policy_loss_names`.
        inputs: the batch (:class:`nemo_sspo.algorithms.losses.LossInputs`).
        max_response_length: L_max for the "constant-denominator" aggregation (Dr. GRPO).
        **params: fields of the loss's config dataclass (its defaults otherwise).

    Returns:
        ``(loss, metrics)``: the 0-d loss to minimise under the loss's own aggregation (0 with a
        zero gradient when nothing is valid), and every metric as a float (``sum / count``, or the
        extreme for ``_min`` / ``_max`` keys, plus ``_std`` keys).

    Raises:
        ValueError: unknown loss or config field (the message names it), the loss's checks, or a
            non-finite loss (names the ``LossInputs`` field holding NaN/inf at valid positions).
    """
    loss = make_policy_loss(name, build_policy_loss_config(name, params, where="params"))
    numerator, denominator, metrics = policy_loss_sums(loss, inputs,
                                                       max_response_length=max_response_length)
    value = torch.where(denominator > 0, numerator / denominator.clamp(min=1), numerator * 0)
    if not bool(torch.isfinite(value)):
        _raise_non_finite_input(inputs, value)
    return value, summarize_metric_pairs(metrics)


def _raise_non_finite_input(inputs: LossInputs, value: torch.Tensor) -> None:
    """Names the input that made the loss non-finite (read only on this error path)."""
    mask = inputs.response_mask
    rows = mask.any(dim=1)
    candidates = [("advantages", inputs.advantages[rows])]
    candidates += [(name, tensor[mask]) for name in ("logprobs", "old_logprobs", "old_entropy",
                                                     "ref_logprobs", "entropy", "token_weights")
                   if (tensor := getattr(inputs, name)) is not None]
    for name, valid in candidates:
        if not bool(torch.isfinite(valid).all()):
            raise ValueError(f"the loss is {float(value)} because LossInputs.{name} holds NaN or inf "
                             "at valid positions; clean the input (masked positions may hold anything)")
    raise ValueError(f"the loss is {float(value)} with finite inputs: the log-ratios overflow "
                     "(check that logprobs and old_logprobs are natural-log probabilities, <= 0)")
