"""The typed interface of every policy loss: :class:`LossInputs` in, :class:`LossOutput` out.

The frame, documented once for every ``[B, T]`` tensor below: row ``b`` is one response (or one
row of a batch whose prompt and response tokens share a row), column ``t`` one predicted token.
Two frames are in use and both work, as long as every tensor of one call uses the same one:

- response positions: ``T`` = longest response, column ``t`` = response token ``t``;
- the sequence's target frame (the trainer's): ``T = S`` positions of prompt + response, column
  ``t`` predicts token ``t + 1``, ``response_mask`` is True only at response targets.

Masked positions are never read (they may hold anything, NaN included). Segment ids are numbered
within a row, so several sequences packed into one row keep their own segments (ratios are per
segment, never per row: docs/pitfalls.md#p2).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch

from nemo_sspo.algorithms.cp_context import CPContext
from nemo_sspo.metrics import MetricPair

__all__ = ["LossInputs", "LossOutput", "LossRequirements", "PolicyLoss"]

_BT_FIELDS = ("old_logprobs", "response_mask", "segment_ids", "old_entropy", "ref_logprobs",
              "entropy", "token_weights")


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss reads for one micro-batch (module docstring for the frame).

    Attributes:
        logprobs: ``[B, T]`` float32/float64, log pi_theta of the sampled tokens (natural log;
            requires grad when training).
        old_logprobs: ``[B, T]`` same dtype family, log pi_old of the same tokens (behaviour policy;
            treated as a constant).
        advantages: ``[B]`` float, A_i of each row's response (constant).
        response_mask: ``[B, T]`` bool, True at tokens that enter the loss.
        segment_ids: ``[B, T]`` int64 segment number of each token within its row (from
            :func:`nemo_sspo.algorithms.segmentation.segment_ids`, -1 where masked), or None.
            Required by losses whose ratio unit is read from text ("newline", "sentence", ...);
            "token" and "response" units are computed from the mask.
        old_entropy: ``[B, T]`` float, old-policy token entropy in nats over the full vocabulary
            (SSPO eq. 12; constant), or None. Required by SSPO's entropy-adaptive bounds; reported
            as ``policy/entropy`` when given.
        ref_logprobs: ``[B, T]`` float, log pi_ref of the tokens (frozen reference policy), or
            None. Required when the config's ``kl_coef > 0``; reported as ``policy/kl_ref``.
        entropy: ``[B, T]`` float, current-policy token entropy (with grad), or None. Required
            when the config's ``entropy_coef > 0``; reported as ``policy/entropy_current``.
        token_weights: ``[B, T]`` float multiplying each token's loss before aggregation
            (off-policy correction weights, ``nemo_sspo.algorithms.off_policy``), or None.
        context_parallel: under context parallelism, this rank's share of the sequence and the
            reductions over its CP group (:class:`nemo_sspo.algorithms.cp_context.CPContext`);
            every ``[B, T]`` field then holds this rank's ``T = S_local`` columns of the target
            frame (``segment_ids`` numbered in the unsplit row). None: the whole sequence.

    Raises:
        ValueError: on construction, naming the field: a shape that is not ``[B, T]`` (``[B]``
            for ``advantages``) like ``logprobs``, a non-bool mask, non-integer segment ids, or
            tensors on different devices.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    segment_ids: torch.Tensor | None = None
    old_entropy: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None
    context_parallel: CPContext | None = None

    def __post_init__(self) -> None:
        lp = self.logprobs
        if lp.dim() != 2 or not lp.is_floating_point():
            raise ValueError(f"LossInputs.logprobs must be a float [B, T] tensor, got "
                             f"{tuple(lp.shape)} {lp.dtype}")
        # advantages first: swapped with a [B, T] tensor, the message names the [B] field.
        if self.advantages.shape != lp.shape[:1]:
            raise ValueError(f"LossInputs.advantages has shape {tuple(self.advantages.shape)}; "
                             f"it must be [B] = [{lp.shape[0]}] (one advantage per row)")
        for name in _BT_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None and tensor.shape != lp.shape:
                raise ValueError(f"LossInputs.{name} has shape {tuple(tensor.shape)} but logprobs "
                                 f"has {tuple(lp.shape)}; every [B, T] field uses one frame")
        if self.response_mask.dtype != torch.bool:
            raise ValueError(f"LossInputs.response_mask must be torch.bool, got "
                             f"{self.response_mask.dtype}")
        ids = self.segment_ids
        if ids is not None and (ids.is_floating_point() or ids.dtype == torch.bool):
            raise ValueError(f"LossInputs.segment_ids must be an integer tensor, got {ids.dtype}")
        cp = self.context_parallel
        if cp is not None and cp.positions.shape != lp.shape[1:]:
            raise ValueError(f"LossInputs.context_parallel.positions has {cp.positions.numel()} "
                             f"positions but the [B, T] fields have T = {lp.shape[1]}")
        devices = {f.name: getattr(self, f.name).device for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        if len(set(devices.values())) > 1:
            raise ValueError(f"LossInputs tensors are on different devices: {devices}")


@dataclass(frozen=True)
class LossOutput:
    """A policy loss's result for one micro-batch.

    Attributes:
        per_token_loss: ``[B, T]`` value TO MINIMISE at each token (differentiable), 0 where
            masked. Reduce it with the config's aggregation
            (:func:`nemo_sspo.algorithms.losses.policy_loss_sums`), never with a plain mean.
        metrics: name -> detached :class:`nemo_sspo.metrics.MetricPair` (keys in
            :mod:`nemo_sspo.algorithms.losses.metrics`).
    """

    per_token_loss: torch.Tensor
    metrics: dict[str, MetricPair] = field(default_factory=dict)


@dataclass(frozen=True)
class LossRequirements:
    """What a configured loss needs from its host, read in one place.

    Attributes:
        segmentation: ratio unit (``nemo_sspo.algorithms.segmentation.SEGMENTATIONS``); the host
            builds ``LossInputs.segment_ids`` with it unless it is "token" or "response".
        segment_k: tokens per segment for "fixed_k", else None.
        advantage_source: "group" (group-relative advantages) or "critic" (SPPO's learned
            prompt value: A = r - sigmoid(V)).
        normalize_std: the loss's default for dividing group-centred rewards by the group std
            (``group_advantages``; a host's own setting may override it).
        reference_policy: keep a frozen reference policy and pass ``ref_logprobs``.
        current_entropy: pass the current-policy entropy ``entropy`` (entropy bonus).
        old_entropy: the loss reads ``old_entropy`` (SSPO's bounds); others only report it.
        dynamic_sampling: the method refills prompt groups whose rewards are all equal (DAPO,
            arXiv 2503.14476 section 3.2); the trainer does so unless its config says otherwise.
    """

    segmentation: str
    segment_k: int | None
    advantage_source: str
    normalize_std: bool
    reference_policy: bool
    current_entropy: bool
    old_entropy: bool
    dynamic_sampling: bool = False

    @property
    def needs_segment_ids(self) -> bool:
        """Whether ``LossInputs.segment_ids`` must be given (units not computed from the mask)."""
        return self.segmentation not in ("token", "response")


@runtime_checkable
class PolicyLoss(Protocol):
    """A policy loss bound to its config: ``loss(inputs) -> LossOutput``.

    Attributes:
        config: carries at least the shared fields of
            :class:`nemo_sspo.algorithms.losses.PolicyLossConfig` (``aggregation`` picks the
            reduction).
        requirements: what the loss needs from its host (:class:`LossRequirements`): a trainer or
            adapter reads only this, never the loss's name.

    Registered losses are built with :func:`nemo_sspo.algorithms.losses.make_policy_loss`.
    """

    config: Any
    requirements: LossRequirements

    def __call__(self, inputs: LossInputs) -> LossOutput:
        """Per-token loss (value to minimise) and metrics of one micro-batch."""
        ...
