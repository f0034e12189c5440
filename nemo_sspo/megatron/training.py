"""Megatron-Core training plumbing: DDP + optimizer set-up, one optimizer step over micro-batches,
and the forward-only pass that recomputes old-policy log-probs and entropies.

Both passes run through ``get_forward_backward_func()``, so the same code drives no pipelining and
1F1B pipeline parallelism. See :mod:`nemo_sspo.megatron.step` for the normalisation contract.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from nemo_sspo.megatron.cpu_shims import cpu_device_context
from nemo_sspo.megatron.step import LossSpec, PolicyBatch, make_forward_step, split_micro_batches
from nemo_sspo.parallel.metrics import merge_metric_sums

__all__ = ["wrap_for_training", "compute_gradients", "train_on_batch", "compute_old_logprobs"]


def wrap_for_training(model: torch.nn.Module, *, lr: float, weight_decay: float, adam_beta1: float,
                      adam_beta2: float, adam_eps: float, clip_grad: float):
    """Wraps ``model`` in Megatron DDP and builds its Adam optimizer.

    Sets ``calculate_per_token_loss`` (the normalisation contract of
    :mod:`nemo_sspo.megatron.step`) and ``finalize_model_grads`` on the model's config before
    wrapping, because DDP reads them to decide its gradient scaling.

    Returns:
        ``(ddp_model, optimizer)``.
    """
    config = get_model_config(model)
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    with cpu_device_context():
        ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1,
                adam_beta2=adam_beta2, adam_eps=adam_eps, clip_grad=clip_grad,
                params_dtype=config.params_dtype, bf16=config.bf16, fp16=config.fp16,
                use_distributed_optimizer=False,
            ),
            [ddp_model],
        )
    return ddp_model, optimizer


def _run_schedule(model, batch: PolicyBatch, spec: LossSpec, micro_batch_size: int, *, forward_only: bool):
    micro = split_micro_batches(batch, micro_batch_size)
    forward_backward = get_forward_backward_func()
    with cpu_device_context():
        return forward_backward(
            forward_step_func=make_forward_step(spec, compute_loss=not forward_only),
            data_iterator=iter(micro),
            model=[model],
            num_microbatches=len(micro),
            seq_length=batch.input_ids.shape[1],
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )


def compute_old_logprobs(model, batch: PolicyBatch, spec: LossSpec, micro_batch_size: int) -> PolicyBatch:
    """Recomputes pi_old log-probs and entropies with the current weights (before any update).

    Returns:
        ``batch`` with ``old_logprobs`` and ``old_entropy`` [B, S] float32 filled on the last
        pipeline stage (other stages return ``batch`` unchanged: they never read these fields).
    """
    model.eval()
    with torch.no_grad():
        outputs = _run_schedule(model, batch, spec, micro_batch_size, forward_only=True)
    model.train()
    if not outputs:
        return batch
    return replace(
        batch,
        old_logprobs=torch.cat([o["logprobs"] for o in outputs]),
        old_entropy=torch.cat([o["entropy"] for o in outputs]),
    )


def compute_gradients(model, batch: PolicyBatch, spec: LossSpec, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """Zeroes and accumulates the step's gradients (``param.main_grad``) over ``batch``'s micro-batches.

    After the call the gradients are already summed over data-parallel ranks and divided by the
    global denominator (``finalize_model_grads``).

    Returns:
        metric name -> float32 [2] (sum, count) summed over this rank's micro-batches (empty on
        pipeline stages other than the last).
    """
    model.zero_grad_buffer()
    outputs = _run_schedule(model, batch, spec, micro_batch_size, forward_only=False)
    sums: dict[str, torch.Tensor] = {}
    for out in outputs:
        sums = merge_metric_sums(sums, out)
    return sums


def train_on_batch(model, optimizer, batch: PolicyBatch, spec: LossSpec, micro_batch_size: int):
    """One optimizer step on ``batch`` split into micro-batches (gradient accumulation).

    Returns:
        ``(metric_sums, grad_norm)``: see :func:`compute_gradients`; the global gradient norm
        before clipping (float).
    """
    optimizer.zero_grad()
    sums = compute_gradients(model, batch, spec, micro_batch_size)
    with cpu_device_context():
        _, grad_norm, _ = optimizer.step()
        if grad_norm is None:
            grad_norm = optimizer.get_grad_norm()
    return sums, float(grad_norm)
