"""forward_step / loss_func glue between Megatron-Core's pipeline schedules and the policy losses.

Normalisation contract (one for every loss and every parallel layout): ``loss_func`` returns
``(numerator, denominator, metrics)`` with ``TransformerConfig.calculate_per_token_loss = True``.
The schedule then neither divides by the micro-batch count nor by the denominator; instead
``finalize_model_grads`` sums the denominators over all micro-batches and data-parallel ranks
(broadcast from the last pipeline stage) and scales the gradients by ``1 / total``. With Megatron's
DDP summing gradients over data-parallel ranks (it does not average under this flag) the step's
gradient is ``grad(sum of numerators) / sum of denominators``: the global mean defined by the loss's
aggregation mode (tokens for token-mean, responses for the response-level mean of SSPO eq. 16),
whatever the micro-batch size, gradient-accumulation count, TP, PP or DP size.

One stated exception: Clip-Cov and KL-Cov choose their tokens by covariance within the batch the
loss sees, one micro-batch (as their official code does per micro-batch). Their step is invariant
to TP and PP, but a different split of rows into micro-batches (micro-batch size, DP size)
selects different tokens. ``tests/distributed/test_invariance.py`` pins both halves.

All tensors of a :class:`PolicyBatch` are in the *target frame*: position ``j`` holds the
prediction of token ``j + 1`` of ``input_ids`` (Megatron returns logits at every position).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, Callable

import torch

from nemo_sspo.algorithms.batch import PolicyBatch
from nemo_sspo.algorithms.losses import LossInputs, policy_loss_sums
from nemo_sspo.megatron.model import forward_logits
from nemo_sspo.parallel import vocab_parallel_logprobs_entropy

__all__ = ["PolicyBatch", "LossSpec", "make_forward_step", "model_device", "split_micro_batches", "to_device"]


def split_micro_batches(batch, micro_batch_size: int) -> list:
    """Splits a batch into consecutive micro-batches of ``micro_batch_size`` rows.

    ``batch`` is a :class:`PolicyBatch` or any batch with ``input_ids [B, S]`` and ``select(rows)``
    (e.g. the critic's).

    Raises:
        ValueError: the batch size is not a multiple of ``micro_batch_size``.
    """
    rows = batch.input_ids.shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"batch of {rows} rows does not split into micro-batches of {micro_batch_size}")
    return [batch.select(slice(i, i + micro_batch_size)) for i in range(0, rows, micro_batch_size)]


def to_device(batch, device: torch.device):
    """``batch`` (a dataclass of tensors, e.g. :class:`PolicyBatch`) with every tensor field on ``device``.

    The trainer keeps whole batches on the host and moves one micro-batch at a time inside the
    forward step; on CPU this is a no-op copy of the field references.
    """
    moved = {f.name: value.to(device) for f in fields(batch)
             if isinstance(value := getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)


def model_device(model: torch.nn.Module) -> torch.device:
    """Device of the model's (first) parameter: CUDA on GPU hosts, CPU otherwise."""
    return next(model.parameters()).device


@dataclass(frozen=True)
class LossSpec:
    """What ``loss_func`` needs besides the micro-batch.

    Attributes:
        loss: the bound policy loss (``nemo_sspo.algorithms.losses.make_policy_loss``); its
            config's ``aggregation`` picks the reduction.
        tp_group: tensor-parallel process group of the vocab shard (None for a single process).
        vocab_start: first global token id of this rank's logits shard.
        vocab_size: true vocabulary size (ids at or above it are Megatron's padding rows).
        temperature: sampling temperature of the rollouts; divides the logits.
        max_response_length: L_max for the constant-denominator (Dr. GRPO) aggregation.
    """

    loss: Any
    tp_group: Any
    vocab_start: int
    vocab_size: int
    temperature: float
    max_response_length: int


def _token_stats(logits: torch.Tensor, batch: PolicyBatch, spec: LossSpec):
    """Log-probs and entropies [B, S] float32 of the masked targets from [B, S, V_local] logits."""
    mask = batch.loss_mask
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        logits[mask],
        batch.targets[mask],
        tp_group=spec.tp_group,
        vocab_start=spec.vocab_start,
        vocab_size=spec.vocab_size,
        temperature=spec.temperature,
    )
    full_lp = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    full_ent = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    return full_lp.masked_scatter(mask, logprobs), full_ent.masked_scatter(mask, entropy)


def _policy_loss_func(batch: PolicyBatch, spec: LossSpec, logits: torch.Tensor):
    logprobs, entropy = _token_stats(logits, batch, spec)
    inputs = LossInputs(
        logprobs=logprobs, old_logprobs=batch.old_logprobs, advantages=batch.advantages,
        response_mask=batch.loss_mask, segment_ids=batch.segment_ids,
        old_entropy=batch.old_entropy, ref_logprobs=batch.ref_logprobs, entropy=entropy,
        token_weights=batch.tis_weights,
    )
    numerator, denominator, metrics = policy_loss_sums(
        spec.loss, inputs, max_response_length=spec.max_response_length)
    return numerator, denominator.to(torch.int), metrics


def _logprob_loss_func(batch: PolicyBatch, spec: LossSpec, logits: torch.Tensor):
    logprobs, entropy = _token_stats(logits, batch, spec)
    zero = logits.new_zeros((), dtype=torch.float32)
    return zero, torch.zeros((), dtype=torch.int), {"logprobs": logprobs, "entropy": entropy}


def make_forward_step(spec: LossSpec, *, compute_loss: bool) -> Callable:
    """Builds the ``forward_step_func`` for ``megatron.core.pipeline_parallel.get_forward_backward_func()``.

    Args:
        spec: loss and vocab-shard settings (see :class:`LossSpec`).
        compute_loss: True for a training pass (loss_func returns the policy loss numerator, its
            denominator as int, and metric (sum, count) pairs); False for a forward-only pass whose
            loss_func returns ``{"logprobs": [B, S], "entropy": [B, S]}`` float32 per micro-batch.

    The data iterator yields :class:`PolicyBatch` micro-batches; every pipeline stage receives the
    same ones (the first stage reads ``input_ids``, the last the loss fields).
    """
    loss_func = _policy_loss_func if compute_loss else _logprob_loss_func

    def forward_step(data_iterator: Iterator[PolicyBatch], model: torch.nn.Module):
        batch = to_device(next(data_iterator), model_device(model))
        output = forward_logits(model, batch.input_ids, batch.position_ids)
        return output, partial(loss_func, batch, spec)

    return forward_step
