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

Mixture-of-experts models (Qwen3-MoE): expert parallelism only moves tokens between the replicas'
experts, so the step is the EP 1 step (``tests/integration/test_moe_expert_parallel_loop.py`` pins
EP 2 against EP 1, with router replay R2). The second stated exception is HF's auxiliary
load-balancing loss (``LossSpec.router_aux_loss_coef > 0``, :mod:`nemo_sspo.algorithms.load_balancing`):
it is a function of the token statistics of one forward, so each micro-batch ``m`` adds
``coef * aux_m * denominator_m`` to its numerator, and the step's term is
``coef * sum_m aux_m * denominator_m / sum_m denominator_m``, the denominator-weighted mean of the
micro-batches' own HF losses over all micro-batches and data-parallel ranks. With one micro-batch
holding the whole batch it is HF's term; another split (micro-batch size, token budget, packing,
DP size) gives other values, because ``aux`` is not additive over tokens; EP gives the value of its
DP split. PP needs every layer's router statistics on one stage, so ``coef > 0`` requires PP = 1
(MoE training under TP needs sequence parallelism, whose routers see their rank's positions: the
statistics are gathered over TP, :func:`nemo_sspo.megatron.moe.recording_router_logits`). With ``coef = 0`` the MoE step keeps the whole contract.
``tests/unit/algorithms/test_moe_aux_loss.py`` and ``tests/distributed/test_moe_aux_loss.py`` pin both halves.

All tensors of a :class:`PolicyBatch` are in the *target frame*: position ``j`` holds the
prediction of token ``j + 1`` of ``input_ids``.

Output layer: by default (``LossSpec.output_chunk_size`` set) the last stage returns its final
hidden states and the loss computes log-probs and entropies only at the response targets, from the
hidden states and this rank's vocab shard of the output weight, one chunk of tokens at a time
(:func:`nemo_sspo.parallel.fused_linear_logprobs_entropy`): the ``[B, S, V_local]`` logits never
exist. With ``output_chunk_size=None`` Megatron's output layer computes the logits at every
position and the loss reads the target rows (:func:`nemo_sspo.parallel.vocab_parallel_logprobs_entropy`).

Context parallelism (``LossSpec.cp_group`` set, ``parallel.context_parallel_size > 1``): each
micro-batch is padded to a multiple of 2 x CP and split with Megatron's load-balanced split
(:func:`nemo_sspo.parallel.context_parallel.split_micro_batch`) before the model runs; the loss
gets this rank's columns and a ``CPContext`` over the CP group, so its numerator and denominator
are this rank's shares (Megatron sums them, and the gradients, over data x context parallelism)
and its metrics are already reduced over CP. Forward-only passes gather the log-probs and
entropies back to the unsplit rows. Tested on CPU: the loss under the emulated split
(``tests/distributed/test_context_parallel_loss.py``); not tested here: the CP attention forward
(TransformerEngine, GPU only).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass, replace
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist

from nemo_sspo.algorithms.batch import PolicyBatch
from nemo_sspo.algorithms.load_balancing import load_balancing_loss
from nemo_sspo.algorithms.micro_batches import MicroBatch
from nemo_sspo.algorithms.losses import LossInputs, policy_loss_sums
from nemo_sspo.megatron.model import forward_hidden, forward_logits, output_weight
from nemo_sspo.megatron.moe import recording_router_logits
from nemo_sspo.megatron.router_replay import router_width
from nemo_sspo.metrics import mean_pair
from nemo_sspo.parallel import fused_linear_logprobs_entropy, vocab_parallel_logprobs_entropy
from nemo_sspo.parallel.context_parallel import gather_sequence, make_cp_context, split_micro_batch

__all__ = ["PolicyBatch", "LossSpec", "make_forward_step", "model_device", "policy_forward_step",
           "split_micro_batches", "to_device"]


def split_micro_batches(batch, micro_batch_size: int) -> list:
    """Consecutive micro-batches of ``micro_batch_size`` rows of a batch with ``input_ids [B, S]``
    and ``select(rows)`` (the critic's; the policy's are planned by
    :class:`nemo_sspo.algorithms.micro_batches.MicroBatchLayout`).

    Raises:
        ValueError: the batch size is not a multiple of ``micro_batch_size``.
    """
    rows = batch.input_ids.shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"batch of {rows} rows does not split into micro-batches of {micro_batch_size}")
    return [batch.select(slice(i, i + micro_batch_size)) for i in range(0, rows, micro_batch_size)]


def to_device(batch, device: torch.device):
    """``batch`` (a dataclass of tensors, possibly nested, e.g. a ``MicroBatch``) with every tensor
    field on ``device``.

    The trainer keeps whole batches on the host and moves one micro-batch at a time inside the
    forward step; on CPU this is a no-op copy of the field references.
    """
    moved = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            moved[f.name] = value.to(device)
        elif is_dataclass(value):
            moved[f.name] = to_device(value, device)
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
        output_chunk_size: tokens per chunk of the fused output layer (module docstring), or None
            to let Megatron's output layer compute the full logits.
        router_aux_loss_coef: weight of HF's load-balancing loss in the training forwards of a
            mixture-of-experts model (``model.router_aux_loss_coef``; 0 = off; module docstring).
        cp_group: the context-parallel process group when ``parallel.context_parallel_size > 1``
            (module docstring), else None.
        output_layer_precision: the fused output layer's matmul precision (``model.output_layer_precision``:
            ``nemo_sspo.parallel.fused_output.OutputPrecision``); read with ``output_chunk_size`` only.
    """

    loss: Any
    tp_group: Any
    vocab_start: int
    vocab_size: int
    temperature: float
    max_response_length: int
    output_chunk_size: int | None
    router_aux_loss_coef: float = 0.0
    cp_group: Any = None
    output_layer_precision: str = "auto"


def _target_rows(output: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    """``[N, X]`` rows of the last stage's output ``[R, S_in, X]`` at the micro-batch's loss
    positions, in ``micro.batch.loss_mask`` order (through ``token_index`` when packed).
    """
    mask = micro.batch.loss_mask
    if micro.token_index is None:
        return output[mask]
    return output.reshape(-1, output.shape[-1])[micro.token_index[mask]]


def _token_stats(output: torch.Tensor, micro: MicroBatch, spec: LossSpec, model):
    """Log-probs and entropies [b, S_b] float32 of the masked targets, from the last stage's
    output: logits [R, S_in, V_local], or hidden states [R, S_in, H] with the fused output layer.
    """
    batch = micro.batch
    mask = batch.loss_mask
    rows = _target_rows(output, micro)
    shard = dict(tp_group=spec.tp_group, vocab_start=spec.vocab_start, vocab_size=spec.vocab_size,
                 temperature=spec.temperature)
    if spec.output_chunk_size is None:
        logprobs, entropy = vocab_parallel_logprobs_entropy(rows, batch.targets[mask], **shard)
    else:
        weight = output_weight(model)
        logprobs, entropy = fused_linear_logprobs_entropy(
            rows.to(weight.dtype), weight, batch.targets[mask],
            chunk_size=spec.output_chunk_size, precision=spec.output_layer_precision, **shard)
    full_lp = torch.zeros(mask.shape, dtype=torch.float32, device=output.device)
    full_ent = torch.zeros(mask.shape, dtype=torch.float32, device=output.device)
    return full_lp.masked_scatter(mask, logprobs), full_ent.masked_scatter(mask, entropy)


def _policy_loss_func(spec: LossSpec, micro: MicroBatch, model, output: torch.Tensor, *, cp=None):
    logprobs, entropy = _token_stats(output, micro, spec, model)
    batch = micro.batch
    inputs = LossInputs(
        logprobs=logprobs, old_logprobs=batch.old_logprobs, advantages=batch.advantages,
        response_mask=batch.loss_mask, segment_ids=batch.segment_ids,
        old_entropy=batch.old_entropy, ref_logprobs=batch.ref_logprobs, entropy=entropy,
        token_weights=batch.tis_weights, context_parallel=cp,
    )
    numerator, denominator, metrics = policy_loss_sums(
        spec.loss, inputs, max_response_length=spec.max_response_length)
    return numerator, denominator.to(torch.int), metrics


def _router_token_mask(micro: MicroBatch, tokens: int, width: int) -> torch.Tensor:
    """``[N]`` bool: the router rows (sequence-first, ``s * R + r``) of real tokens, not padding;
    ``width``: the row width the routers saw (padded for sequence parallelism).
    """
    rows = micro.input_ids.shape[0]
    if micro.sequence_lengths is not None:
        valid = torch.arange(width)[None, :] < micro.sequence_lengths.sum()
    else:
        valid = torch.arange(width)[None, :] < micro.batch.row_lengths()[:, None].cpu()
    if tokens != rows * width:
        raise ValueError(f"the MoE routers saw {tokens} tokens for a [{rows}, {width}] micro-batch; "
                         "the auxiliary loss needs one router row per input token: set "
                         "router_aux_loss_coef=0 for this layout")
    return valid.transpose(0, 1).reshape(-1).to(micro.input_ids.device)


def _aux_policy_loss_func(spec: LossSpec, micro: MicroBatch, model, output: torch.Tensor, *, records: list):
    """:func:`_policy_loss_func` plus ``coef * aux * denominator`` (module docstring)."""
    numerator, denominator, metrics = _policy_loss_func(spec, micro, model, output)
    if micro.batch.input_ids.shape[0] == 0:  # a pass-count filler: no rows, weight 0
        return numerator, denominator, metrics
    if not records:
        raise ValueError("router_aux_loss_coef > 0 needs a mixture-of-experts model: this forward ran no "
                         "MoE router; set it to 0")
    logits = torch.stack([logit for logit, _ in records])
    routing_map = torch.stack([chosen for _, chosen in records])
    aux = load_balancing_loss(logits, routing_map,
                              _router_token_mask(micro, logits.shape[1], router_width(micro, model)))
    weight = denominator.to(torch.float32)
    metrics["moe/aux_loss"] = mean_pair(aux.detach() * weight, weight)
    return numerator + spec.router_aux_loss_coef * aux * weight, denominator, metrics


def _recording_routers(spec: LossSpec, run_model: Callable) -> Callable:
    """The training forward step with the auxiliary loss: each micro-batch's forward records its
    routers (:func:`nemo_sspo.megatron.moe.recording_router_logits`) for its own loss call.
    """

    def forward_step(data_iterator: Iterator, model: torch.nn.Module):
        micro = to_device(next(data_iterator), model_device(model))
        with recording_router_logits(model) as records:
            output = run_model(model, micro)
        return output, partial(_aux_policy_loss_func, spec, micro, model, records=records)

    return forward_step


def _logprob_loss_func(spec: LossSpec, micro: MicroBatch, model, output: torch.Tensor, *, cp=None,
                       width: int | None = None):
    logprobs, entropy = _token_stats(output, micro, spec, model)
    if cp is not None:  # forward-only outputs: the unsplit rows, trimmed to the micro-batch's width
        logprobs, entropy = (gather_sequence(x, spec.cp_group)[:, :width] for x in (logprobs, entropy))
    zero = output.new_zeros((), dtype=torch.float32)
    return zero, torch.zeros((), dtype=torch.int), {"logprobs": logprobs, "entropy": entropy}


def _run_rows(model, batch) -> torch.Tensor:
    return forward_logits(model, batch.input_ids, batch.position_ids)


def make_forward_step(loss_func: Callable, *, run_model: Callable = _run_rows) -> Callable:
    """The ``forward_step_func`` for ``megatron.core.pipeline_parallel.get_forward_backward_func()``.

    Args:
        loss_func: ``loss_func(batch, model, output) -> (numerator, denominator, metrics)``, run on
            the last pipeline stage with that stage's output (Megatron's loss-function contract
            with ``calculate_per_token_loss``).
        run_model: ``run_model(model, micro_batch) -> output``; by default the logits of the
            micro-batch's ``input_ids`` rows.

    The data iterator yields micro-batches (dataclasses with ``input_ids``/``position_ids``, e.g.
    a ``MicroBatch`` or the critic's); every pipeline stage receives the same ones (the first
    stage reads ``input_ids``, the last the loss fields). Each is moved to the model's device here.
    """

    def forward_step(data_iterator: Iterator, model: torch.nn.Module):
        batch = to_device(next(data_iterator), model_device(model))
        return run_model(model, batch), partial(loss_func, batch, model)

    return forward_step


def policy_forward_step(spec: LossSpec, *, compute_loss: bool) -> Callable:
    """The policy's forward step (:func:`make_forward_step`).

    Args:
        spec: loss, vocab-shard and output-layer settings (:class:`LossSpec`).
        compute_loss: True for a training pass (the policy loss's numerator, plus HF's
            load-balancing loss when ``spec.router_aux_loss_coef > 0``, its denominator as int, and
            metric pairs, ``moe/aux_loss`` among them); False for a forward-only pass returning
            ``{"logprobs": [b, S_b], "entropy": [b, S_b]}`` float32 per micro-batch.

    The data iterator yields :class:`nemo_sspo.algorithms.micro_batches.MicroBatch` objects.
    """
    loss_func = _policy_loss_func if compute_loss else _logprob_loss_func
    forward = forward_logits if spec.output_chunk_size is None else forward_hidden

    def run_model(model, micro: MicroBatch) -> torch.Tensor:
        return forward(model, micro.input_ids, micro.position_ids,
                       sequence_lengths=micro.sequence_lengths)

    if spec.cp_group is not None:
        return _context_parallel_step(spec, loss_func, run_model)
    if compute_loss and spec.router_aux_loss_coef > 0:
        return _recording_routers(spec, run_model)
    return make_forward_step(partial(loss_func, spec), run_model=run_model)


def _context_parallel_step(spec: LossSpec, loss_func: Callable, run_model: Callable) -> Callable:
    """The forward step under context parallelism (module docstring): split, run, loss with the
    rank's ``CPContext``.
    """
    size, rank = dist.get_world_size(spec.cp_group), dist.get_rank(spec.cp_group)

    def forward_step(data_iterator: Iterator, model: torch.nn.Module):
        micro = to_device(next(data_iterator), model_device(model))
        width = micro.batch.loss_mask.shape[1]
        local, positions, padded = split_micro_batch(micro, size, rank)
        cp = make_cp_context(spec.cp_group, positions.to(local.input_ids.device), padded)
        extra = {"cp": cp} if loss_func is _policy_loss_func else {"cp": cp, "width": width}
        return run_model(model, local), partial(loss_func, spec, local, model, **extra)

    return forward_step
