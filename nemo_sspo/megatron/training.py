"""Megatron-Core training plumbing: DDP + optimizer set-up, one optimizer step over micro-batches,
and the forward-only passes that compute old-policy (or reference-policy) log-probs and entropies.

Every pass runs through ``get_forward_backward_func()`` (:func:`run_schedule`), so the same code
drives no pipelining and 1F1B pipeline parallelism, for the policy and for other models with their
own forward step (the SPPO critic). See :mod:`nemo_sspo.megatron.step` for the normalisation
contract.

Every data-parallel rank runs the same number of passes over a mini-batch, forward-only or not
(:func:`plan_micro_batches`): ranks plan their own micro-batches, and a forward that all-reduces
over the data-parallel group (TransformerEngine's FP8 amax under the delayed recipe, expert
dispatch, context parallelism) would otherwise wait forever on the rank with fewer
(docs/pitfalls.md#equal-pass-counts).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from nemo_sspo.algorithms.batch import PolicyBatch
from nemo_sspo.algorithms.micro_batches import MicroBatch, MicroBatchLayout, pad_micro_batches
from nemo_sspo.megatron.cpu_shims import cpu_device_context
from nemo_sspo.megatron.lr_schedule import LrSchedule
from nemo_sspo.megatron.packed_seq import padded_width
from nemo_sspo.megatron.router_replay import (
    recording_forward_step,
    replaying_forward_step,
    write_micro_batch_routes,
)
from nemo_sspo.megatron.sequence_parallel import sequence_parallel_size
from nemo_sspo.megatron.step import LossSpec, policy_forward_step
from nemo_sspo.metrics import merge_metric_sums
from nemo_sspo.parallel.data_balance import agree_micro_batch_count

__all__ = [
    "accumulate_gradients",
    "apply_optimizer_step",
    "build_lr_scheduler",
    "compute_gradients",
    "compute_old_logprobs",
    "compute_ref_logprobs",
    "forward_logprobs",
    "plan_micro_batches",
    "run_schedule",
    "train_on_batch",
    "wrap_for_training",
]


def wrap_for_training(model: torch.nn.Module, *, lr: float, weight_decay: float, adam_beta1: float,
                      adam_beta2: float, adam_eps: float, clip_grad: float, use_distributed_optimizer: bool = False,
                      cpu_offload: bool = False):
    """Wraps ``model`` in Megatron DDP and builds its Adam optimizer.

    Sets ``calculate_per_token_loss`` (the normalisation contract of
    :mod:`nemo_sspo.megatron.step`) and ``finalize_model_grads`` on the model's config before
    wrapping, because DDP reads them to decide its gradient scaling. A BF16 model
    (``config.bf16``, ``model.precision=bf16``) is first wrapped in Megatron's ``Float16Module``
    (BF16 compute, FP32 logits on the last stage), and its optimizer keeps FP32 main weights
    (Megatron's mixed-precision optimizer), as Megatron-LM's ``get_model`` does.

    Memory per parameter (bytes; Megatron's mixed-precision optimizer keeps its gradients in the
    DDP buffer in fp32, ``grad_reduce_in_fp32``): weights 2 (bf16) or 4 (fp32), gradients 4, Adam
    ``exp_avg`` + ``exp_avg_sq`` 8, plus the fp32 main weights 4 for a bf16 model. With
    ``use_distributed_optimizer`` the Adam states and main weights are sharded over the
    data-parallel group (each rank keeps the 1/DP slice of the DDP buffer it owns); gradients
    are reduce-scattered into those slices and the updated weights all-gathered after the step,
    so the step equals plain Adam's.

    Args:
        model: this rank's ``GPTModel`` stage (or value model), not yet wrapped.
        lr: the learning rate (the peak of a schedule, :func:`build_lr_scheduler`).
        weight_decay: decoupled weight decay.
        adam_beta1: Adam's beta1.
        adam_beta2: Adam's beta2.
        adam_eps: Adam's epsilon.
        clip_grad: global gradient-norm clip, 0 disables.
        use_distributed_optimizer: megatron-core's ``DistributedOptimizer`` (config key
            ``optim.use_distributed_optimizer``).
        cpu_offload: optimizer states and the Adam update on the host (megatron-core's
            ``optimizer_cpu_offload`` with the whole share offloaded; ``optim.cpu_offload``).

    Returns:
        ``(ddp_model, optimizer)``: ``ddp_model.module`` is the model (or its ``Float16Module``).

    Raises:
        ValueError: ``cpu_offload`` without ``use_distributed_optimizer``.
    """
    if cpu_offload and not use_distributed_optimizer:
        raise ValueError("cpu_offload=True needs use_distributed_optimizer=True (megatron-core offloads the "
                         "distributed optimizer's states)")
    config = get_model_config(model)
    if config.bf16 or config.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
    )
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0) if cpu_offload else {}
    with cpu_device_context():
        ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1,
                adam_beta2=adam_beta2, adam_eps=adam_eps, clip_grad=clip_grad,
                params_dtype=config.params_dtype, bf16=config.bf16, fp16=config.fp16,
                use_distributed_optimizer=use_distributed_optimizer, **offload,
            ),
            [ddp_model],
        )
    return ddp_model, optimizer


def build_lr_scheduler(optimizer, *, lr: float, min_lr: float, schedule: str, warmup_steps: int,
                       decay_steps: int):
    """megatron-core's ``OptimizerParamScheduler`` for ``optimizer``: linear warmup, then decay.

    Update ``k`` (1-based; :func:`apply_optimizer_step` advances the schedule before each update)
    runs at ``lr * k / warmup_steps`` for ``k <= warmup_steps``; after it, ``constant`` keeps ``lr``,
    ``linear`` and ``cosine`` go from ``lr`` to ``min_lr`` at ``k = decay_steps`` (Megatron-LM's
    formulas: ``min_lr + (lr - min_lr) * c`` with ``c = 1 - r`` or ``(1 + cos(pi r)) / 2``,
    ``r = (k - warmup_steps) / (decay_steps - warmup_steps)``), and stay at ``min_lr`` past it.
    (Megatron-LM steps its scheduler after the update, so its first update runs at the warmup's
    initial 0; stepping first is ours: no update is wasted at learning rate 0.) Weight decay stays
    constant.

    Args:
        optimizer: a Megatron optimizer (:func:`wrap_for_training`).
        lr: peak learning rate.
        min_lr: final learning rate of a decay.
        schedule: an :class:`~nemo_sspo.megatron.lr_schedule.LrSchedule` (config key ``optim.lr_schedule``);
            the scheduler keeps it as a plain string (its ``state_dict`` goes into checkpoints).
        warmup_steps: updates of linear warmup (0 = none).
        decay_steps: the update at which a decay reaches ``min_lr`` (warmup included).

    Returns:
        The scheduler; its ``state_dict()`` goes into checkpoints, and a resumed run restores only
        its update count (``load_state_dict`` keeps this run's settings: an allowed change of the
        learning rate on resume takes effect).

    Raises:
        ValueError: an unknown ``schedule``, ``decay_steps <= warmup_steps`` or ``min_lr`` outside ``[0, lr]``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if schedule not in tuple(LrSchedule):
        raise ValueError(f"schedule={schedule!r} is unknown; valid: {', '.join(LrSchedule)}")
    if not (decay_steps > warmup_steps >= 0 and 0 <= min_lr <= lr):
        raise ValueError(f"need decay_steps > warmup_steps >= 0 and 0 <= min_lr <= lr, got decay_steps="
                         f"{decay_steps}, warmup_steps={warmup_steps}, min_lr={min_lr}, lr={lr}")
    weight_decay = optimizer.param_groups[0]["weight_decay"] if optimizer.param_groups else 0.0
    for group in optimizer.param_groups:  # Megatron's groups carry their own bounds (None unless set)
        group["max_lr"], group["min_lr"] = lr, min_lr
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup_steps else lr, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=str(schedule), start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=decay_steps, wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True)


def run_schedule(model, micro_batches: list, forward_step_func: Callable, *, forward_only: bool,
                 on_micro_batch: Callable[[int, int], None] | None = None) -> list:
    """Runs Megatron's forward(-backward) schedule over ``micro_batches``.

    Args:
        model: a (DDP-wrapped or bare) Megatron model chunk of this pipeline stage.
        micro_batches: batches with ``input_ids [b, S]``. When their shapes differ (token-budget
            or packed layouts), or they are packed rows (``sequence_lengths`` set: the THD layout
            may pad a row inside ``forward_logits``, so activations can be longer than ``S``), the
            pipeline sends each activation's shape first (Megatron's ``variable_seq_lengths``),
            for this call only.
        forward_step_func: ``forward_step(data_iterator, model) -> (output, loss_func)``.
        forward_only: no backward pass (no gradients are touched).
        on_micro_batch: told ``(k, M)`` as this stage starts the forward of micro-batch k of M
            (progress reports; None: nobody).

    Returns:
        The loss functions' third outputs (metrics / per-micro-batch results), one per
        micro-batch on the last pipeline stage; an empty list on other stages.
    """
    forward_backward = get_forward_backward_func()
    if on_micro_batch is not None:
        forward_step_func = _counted(forward_step_func, len(micro_batches), on_micro_batch)
    config = get_model_config(model)
    shapes = {tuple(micro.input_ids.shape) for micro in micro_batches}
    packed = any(getattr(micro, "sequence_lengths", None) is not None for micro in micro_batches)
    saved, config.variable_seq_lengths = config.variable_seq_lengths, len(shapes) > 1 or packed
    with cpu_device_context(), _restored(config, "variable_seq_lengths", saved):
        return forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            # Sequence parallelism pads each row to a multiple of TP (forward_logits); the schedule
            # sizes the pipeline's [S / tp, B, H] activations from the padded width.
            seq_length=padded_width(micro_batches[0].input_ids.shape[1], sequence_parallel_size(config)),
            micro_batch_size=micro_batches[0].input_ids.shape[0],
            forward_only=forward_only,
        )


@contextmanager
def _restored(obj, name: str, value):
    try:
        yield
    finally:
        setattr(obj, name, value)


def plan_micro_batches(layout: MicroBatchLayout, batch: PolicyBatch, *, dp_group) -> list[MicroBatch]:
    """This rank's micro-batches, as many as on every other data-parallel rank.

    ``layout.plan(batch)`` padded with empty micro-batches to the largest count of any
    data-parallel rank (:func:`nemo_sspo.parallel.data_balance.agree_micro_batch_count`, then
    :func:`nemo_sspo.algorithms.micro_batches.pad_micro_batches`).

    Collective over ``dp_group`` (one all-reduce of an int): every rank calls it for the same
    mini-batch. The empty micro-batches add exactly zero to loss, gradients, denominators,
    metrics and written-back outputs.

    Args:
        layout: how this rank cuts its rows.
        batch: this rank's rows of the mini-batch, ``[B_r, S]``.
        dp_group: the data-parallel process group, or None for one rank.

    Returns:
        The micro-batches this rank runs, as many as on every other data-parallel rank.

    Raises:
        ValueError: as ``layout.plan``.
    """
    micro_batches = layout.plan(batch)
    return pad_micro_batches(micro_batches, agree_micro_batch_count(len(micro_batches), dp_group))


def forward_logprobs(model, batch: PolicyBatch, spec: LossSpec, layout: MicroBatchLayout, *, dp_group,
                     recorded: list | None = None):
    """Log-probs and entropies of ``batch.targets`` under ``model``, forward only, in eval mode.

    The model's train/eval mode is restored afterwards. ``layout`` cuts ``batch`` into
    micro-batches, padded to the same count on every data-parallel rank of ``dp_group``
    (:func:`plan_micro_batches`; None for one rank); each one's results are written back at its
    rows. A batch carrying ``routes`` (router replay) routes every token of a MoE model to those
    experts.

    Args:
        model: the policy (or reference) Megatron model stage.
        batch: this rank's rows.
        spec: what the forward step computes (log-probs, entropies).
        layout: how ``batch`` is cut into micro-batches.
        dp_group: the data-parallel process group, or None for one rank.
        recorded: a list to receive ``(micro_batch, routes)`` of every micro-batch (MoE models:
            the experts each input token went to, :func:`~nemo_sspo.megatron.router_replay.recording_forward_step`),
            on every pipeline stage; None records nothing.

    Returns:
        ``(logprobs, entropy)``, each [B, S] float32 in the target frame (0 outside the mask), on
        the host (CPU, where the trainer keeps whole batches), on the last pipeline stage; None on
        other stages.
    """
    was_training = model.training
    model.eval()
    micro_batches = plan_micro_batches(layout, batch, dp_group=dp_group)
    step = _routed(policy_forward_step(spec, compute_loss=False), batch)
    if recorded is not None:
        step = recording_forward_step(step, recorded)
    with torch.no_grad():
        outputs = run_schedule(model, micro_batches, step, forward_only=True)
    model.train(was_training)
    if not outputs:
        return None
    return tuple(_reassemble(batch.loss_mask.shape, micro_batches, [o[key] for o in outputs])
                 for key in ("logprobs", "entropy"))


def _routed(forward_step: Callable, batch: PolicyBatch) -> Callable:
    """``forward_step``, replaying ``batch.routes`` when the batch carries routes."""
    return forward_step if batch.routes is None else replaying_forward_step(forward_step)


def _reassemble(shape, micro_batches: list, parts: list[torch.Tensor]) -> torch.Tensor:
    """``[B, S]`` float32 on the host from per-micro-batch ``[b, S_b]`` results at their rows."""
    out = torch.zeros(shape, dtype=torch.float32)
    for micro, part in zip(micro_batches, parts, strict=True):
        out[micro.rows, : part.shape[1]] = part.cpu()
    return out


def compute_old_logprobs(model, batch: PolicyBatch, spec: LossSpec, layout: MicroBatchLayout, *,
                         dp_group, record_routes: bool = False) -> PolicyBatch:
    """Recomputes pi_old log-probs and entropies with the current weights (before any update).

    Runs :func:`forward_logprobs` (``dp_group`` as there).

    Args:
        model: the policy's Megatron model stage.
        batch: this rank's rows.
        spec: what the forward step computes.
        layout: how ``batch`` is cut into micro-batches.
        dp_group: as :func:`forward_logprobs`.
        record_routes: router replay R2 (MoE models): keep the experts this forward chose for every
            input token as ``batch.routes`` [B, S, L, k] (this stage's L MoE layers), which the
            training forwards then replay.

    Returns:
        ``batch`` with ``old_logprobs`` and ``old_entropy`` [B, S] float32 filled on the last
        pipeline stage (other stages return ``batch`` unchanged: they never read these fields),
        and with R2 ``routes`` on every stage.

    Raises:
        ValueError: ``record_routes`` for a batch that already carries routes.
    """
    if record_routes and batch.routes is not None:
        raise ValueError("compute_old_logprobs(record_routes=True) got a batch that already carries routes")
    recorded = [] if record_routes else None
    stats = forward_logprobs(model, batch, spec, layout, dp_group=dp_group, recorded=recorded)
    if recorded:
        first = recorded[0][1]
        routes = torch.zeros(*batch.input_ids.shape, *first.shape[2:], dtype=first.dtype)
        for micro, micro_routes in recorded:
            write_micro_batch_routes(routes, micro, micro_routes)
        batch = replace(batch, routes=routes)
    if stats is None:
        return batch
    return replace(batch, old_logprobs=stats[0], old_entropy=stats[1])


def compute_ref_logprobs(ref_model, batch: PolicyBatch, spec: LossSpec, layout: MicroBatchLayout, *,
                         dp_group, keep_routes: bool = False) -> PolicyBatch:
    """The log pi_ref of the targets under the frozen reference policy (the reference-KL term).

    Runs :func:`forward_logprobs` (``dp_group`` as there).

    Args:
        ref_model: the reference model stage.
        batch: this rank's rows.
        spec: what the forward step computes.
        layout: how ``batch`` is cut into micro-batches.
        dp_group: as :func:`forward_logprobs`.
        keep_routes: replay ``batch.routes`` in the reference forward too (router replay R3: the
            engine's routes); False routes with the reference's own routers (R2 replays the
            old-policy routes in the policy's training forwards only).

    Returns:
        ``batch`` with ``ref_logprobs`` [B, S] float32 (0 outside the mask) on the last pipeline
        stage; other stages return ``batch`` unchanged.
    """
    routed = batch if keep_routes else replace(batch, routes=None)
    stats = forward_logprobs(ref_model, routed, spec, layout, dp_group=dp_group)
    return batch if stats is None else replace(batch, ref_logprobs=stats[0])


def _counted(forward_step_func: Callable, total: int, on_micro_batch: Callable[[int, int], None]) -> Callable:
    """``forward_step_func`` that first tells ``on_micro_batch`` which of ``total`` forwards starts."""
    started = itertools.count(1)

    def forward_step(data_iterator, model):
        on_micro_batch(next(started), total)
        return forward_step_func(data_iterator, model)

    return forward_step


def accumulate_gradients(model, micro_batches: list, forward_step_func: Callable, *,
                         on_micro_batch: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """Zeroes and accumulates one step's gradients (``param.main_grad``) over ``micro_batches``.

    After the call the gradients are already summed over data-parallel ranks and divided by the
    global denominator (``finalize_model_grads``; the loss functions return ``(numerator,
    denominator, metrics)``). ``on_micro_batch``: as :func:`run_schedule`.

    Returns:
        metric name -> ``MetricPair`` merged over this rank's micro-batches (empty on pipeline
        stages other than the last).
    """
    model.zero_grad_buffer()
    sums: dict[str, torch.Tensor] = {}
    for out in run_schedule(model, micro_batches, forward_step_func, forward_only=False, on_micro_batch=on_micro_batch):
        sums = merge_metric_sums(sums, out)
    return sums


def compute_gradients(model, batch: PolicyBatch, spec: LossSpec, layout: MicroBatchLayout, *,
                      dp_group, on_micro_batch: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """The policy loss's gradients over ``batch`` cut into micro-batches by ``layout``.

    As many micro-batches run on every rank of ``dp_group`` (:func:`plan_micro_batches`); a batch
    carrying ``routes`` replays them (router replay); see :func:`accumulate_gradients`, whose metric
    sums it returns.
    """
    return accumulate_gradients(model, plan_micro_batches(layout, batch, dp_group=dp_group),
                                _routed(policy_forward_step(spec, compute_loss=True), batch),
                                on_micro_batch=on_micro_batch)


def apply_optimizer_step(optimizer, lr_scheduler=None) -> float:
    """Steps ``optimizer`` on the accumulated gradients; returns the global gradient norm before
    clipping (float).

    ``lr_scheduler`` (:func:`build_lr_scheduler`, or None for a constant rate) is advanced by one
    update first, so this update runs at the schedule's rate for its own index.
    """
    if lr_scheduler is not None:
        lr_scheduler.step(1)
    with cpu_device_context():
        _, grad_norm, _ = optimizer.step()
        if grad_norm is None:
            grad_norm = optimizer.get_grad_norm()
    return float(grad_norm)


def train_on_batch(model, optimizer, batch: PolicyBatch, spec: LossSpec, layout: MicroBatchLayout, *,
                   dp_group, lr_scheduler=None, on_micro_batch: Callable[[int, int], None] | None = None):
    """One optimizer step on ``batch`` split into micro-batches (gradient accumulation).

    As many micro-batches run on every rank of ``dp_group`` (None for one rank;
    :func:`plan_micro_batches`); ``lr_scheduler`` as :func:`apply_optimizer_step`; ``on_micro_batch``
    as :func:`run_schedule`.

    Returns:
        ``(metric_sums, grad_norm)``: see :func:`compute_gradients`; the global gradient norm
        before clipping (float).
    """
    optimizer.zero_grad()
    sums = compute_gradients(model, batch, spec, layout, dp_group=dp_group, on_micro_batch=on_micro_batch)
    return sums, apply_optimizer_step(optimizer, lr_scheduler)
