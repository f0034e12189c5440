"""The output layer fused with the log-prob/entropy reduction: logits never exist in full.

Under tensor parallelism the output layer's weight is split along the vocabulary: rank ``r``
holds ``W_r [V_local, H]`` for global ids ``[vocab_start, vocab_start + V_local)``. For the ``N``
positions the loss reads (response targets only), this module computes per chunk of tokens

    logits_c = h_c W_r[:n_valid]^T            [chunk, n_valid]   (never more than one chunk)

and feeds the chunk to the same two-collective reduction as
:func:`nemo_sspo.parallel.vocab_parallel_logprobs_entropy` (one all-reduce MAX, one all-reduce
SUM of ``[chunk, 3]``), where ``n_valid <= V_local`` counts the shard's ids below the true
vocabulary size. The backward pass recomputes each chunk's logits from the saved hidden
states and weight shard, turns them into the logits gradient with the same closed form
(``vocab_parallel.logits_gradient``, no communication), and accumulates

    dL/dh_c = G_c W_r[:n_valid]        dL/dW_r[:n_valid] += G_c^T h_c

then sums ``dL/dh`` over the tensor-parallel group (one all-reduce of ``[N, H]``: every rank's
shard contributes to every hidden state, exactly the all-reduce a column-parallel linear layer
does in its backward). Only the shard's valid rows ``W_r[:n_valid]`` (global ids below the true
vocabulary size) enter either product: the padding rows past ``vocab_size`` may hold anything in a
caller's shard (NaN, inf), and even a zero gradient times NaN would be NaN in ``dL/dh``; their
own gradient is exactly 0. Peak extra memory is ``O(chunk x V_local)`` whatever ``N``; a tied
embedding (SmolLM2) and an untied head (Qwen2.5) are the same call with their own weight tensor.
The formulation (chunked matmul + vocab-parallel online softmax + recomputing backward) is ours;
verl's ``linear_cross_entropy`` and NeMo-RL's chunked fused log-probs do the same job.

``precision`` (``model.output_layer_precision``) sets the dtype of the logits matmul: ``auto``
multiplies in the inputs' dtype (bf16 logits for a bf16 model, as Megatron's output layer), ``bf16``
in bf16, ``fp32`` in fp32 and ``tf32`` in fp32 inputs with TF32 tensor-core products on CUDA (plain
fp32 on a CPU). A wider matmul casts the valid weight rows once per forward and once per backward
(one extra ``[n_valid, H]`` tensor in that dtype, e.g. 1.1 GB in fp32 for a 75,968 x 3,584 shard),
and the chunk's logits are in that dtype; the gradients come back in the inputs' dtypes.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from nemo_sspo.choice import Choice
from nemo_sspo.parallel.vocab_parallel import (
    check_finite_outputs,
    check_targets_and_settings,
    chunk_statistics,
    logits_gradient,
    shard_layout_error,
)

__all__ = ["OutputPrecision", "fused_linear_logprobs_entropy", "output_matmul_dtype", "tf32_matmuls"]


class OutputPrecision(Choice):
    """Values of ``precision`` (module docstring; config key ``model.output_layer_precision``)."""

    auto = "auto"
    bf16 = "bf16"
    tf32 = "tf32"
    fp32 = "fp32"


def fused_linear_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    precision: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of the target and full-vocabulary entropy of ``softmax(h W^T / tau)``.

    Equal to ``vocab_parallel_logprobs_entropy(hidden @ weight.T, ...)`` without materialising the
    ``[N, V_local]`` logits (module docstring for the algorithm and its collectives).

    Args:
        hidden: ``[N, H]`` float (bf16/fp16/fp32/fp64) final hidden states of the positions the
            loss reads, identical on every rank of ``tp_group``.
        weight: ``[V_local, H]`` this rank's vocab shard of the output weight (the embedding when
            tied), same dtype and device as ``hidden``.
        targets: ``[N]`` int64 global token ids in ``[0, vocab_size)``.
        tp_group: tensor-parallel group, or None for one process holding the whole vocabulary.
        vocab_start: global id of the shard's first row; Megatron's contiguous equal split.
        vocab_size: true vocabulary size; rows at or above it are padding (probability 0, gradient
            0) and are never read, so their values (even NaN or inf) change nothing.
        temperature: ``tau > 0`` dividing the logits.
        chunk_size: tokens per chunk, ``>= 1`` (peak extra memory ``chunk_size x V_local``).
        precision: the logits matmul's precision, an :class:`OutputPrecision` (module
            docstring); ``auto`` keeps the inputs' dtype.

    Returns:
        ``(logprobs [N], entropy [N])`` in nats, fp32 (fp64 for fp64 input), identical on every
        rank, differentiable w.r.t. ``hidden`` and ``weight``.

    Raises:
        ValueError: shapes, dtypes or devices that do not match, the checks of
            ``vocab_parallel_logprobs_entropy`` (targets, settings, shard layout), an unknown
            ``precision``, or non-finite outputs (NaN/inf hidden states or valid weight rows).
    """
    if precision not in tuple(OutputPrecision):
        raise ValueError(f"precision={precision!r} must be one of {', '.join(OutputPrecision)}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V_local, H] with the same H, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise ValueError(f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, "
                         f"{weight.device}) must be float tensors of one dtype on one device")
    check_targets_and_settings(targets, hidden.shape[0], hidden.device, vocab_start, vocab_size,
                               temperature, chunk_size)
    layout_error = shard_layout_error(weight.shape[0], tp_group, vocab_start, vocab_size)
    if layout_error is not None and (tp_group is None or hidden.shape[0] == 0):
        raise ValueError(layout_error)
    return _FusedLinearLogprobsEntropy.apply(hidden, weight, targets, tp_group, vocab_start,
                                             vocab_size, float(temperature), int(chunk_size),
                                             layout_error, precision)


def output_matmul_dtype(precision: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the logits are multiplied in for inputs of ``dtype`` under ``precision`` (an
    :class:`OutputPrecision`, module docstring): ``dtype`` for ``auto`` and for fp64 inputs, bf16 for
    ``bf16``, fp32 for ``fp32`` and ``tf32``.
    """
    if precision == "auto" or dtype == torch.float64:
        return dtype
    return torch.bfloat16 if precision == "bf16" else torch.float32


@contextmanager
def tf32_matmuls(enabled: bool, device: torch.device):
    """While inside, CUDA fp32 matmuls use TF32 products when ``enabled`` and ``device`` is a GPU
    (``torch.backends.cuda.matmul.fp32_precision = "tf32"``, restored after); otherwise nothing changes.
    """
    if not enabled or device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[chunk, V_local]`` logits of one chunk, in the dtype of ``weight`` (already the matmul's)."""
    return hidden.to(weight.dtype) @ weight.t()


class _FusedLinearLogprobsEntropy(torch.autograd.Function):
    """Autograd function behind :func:`fused_linear_logprobs_entropy` (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, tp_group, vocab_start, vocab_size, temperature,
                chunk_size, layout_error, precision):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        inv_temp = 1.0 / temperature
        n_valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
        # padding rows never enter a product (module docstring); cast once to the matmul's dtype
        valid = weight[:n_valid].to(output_matmul_dtype(precision, weight.dtype))
        pieces = []
        for s in range(0, hidden.shape[0], chunk_size):
            with tf32_matmuls(precision == "tf32", hidden.device):
                logits = _chunk_logits(hidden[s : s + chunk_size], valid)
            pieces.append(chunk_statistics(logits, targets[s : s + chunk_size], tp_group,
                                           vocab_start, n_valid, inv_temp, acc,
                                           layout_error is not None))
        if pieces:
            logprobs, entropy, raw_max, log_sum_exp = (torch.cat(parts) for parts in zip(*pieces, strict=True))
        else:
            logprobs = entropy = raw_max = log_sum_exp = hidden.new_zeros(0, dtype=acc)
        check_finite_outputs(lambda row: _chunk_logits(hidden[row : row + 1], valid)[0], targets,
                             logprobs, entropy, vocab_start, n_valid, layout_error)
        ctx.save_for_backward(hidden, weight, targets, raw_max, log_sum_exp, entropy, logprobs)
        ctx.meta = (vocab_start, n_valid, inv_temp, chunk_size, acc)
        ctx.tp_group, ctx.precision = tp_group, precision
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        none = (None,) * 8
        if grad_logprobs is None and grad_entropy is None:
            return (None, None, *none)
        hidden, weight, targets, *stats = ctx.saved_tensors
        n_valid, chunk = ctx.meta[1], ctx.meta[3]
        valid = weight[:n_valid].to(output_matmul_dtype(ctx.precision, weight.dtype))
        tf32 = ctx.precision == "tf32"
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        grad_valid = grad_weight[:n_valid]  # padding rows keep their exact 0
        for s in range(0, hidden.shape[0], chunk):
            rows = slice(s, s + chunk)
            with tf32_matmuls(tf32, hidden.device):
                logits = _chunk_logits(hidden[rows], valid)
            grad_logits = logits_gradient(
                logits, targets[rows], [stat[rows] for stat in stats],
                None if grad_logprobs is None else grad_logprobs[rows],
                None if grad_entropy is None else grad_entropy[rows], ctx.meta)
            with tf32_matmuls(tf32, hidden.device):
                grad_hidden[rows] = (grad_logits @ valid).to(hidden.dtype)
            grad_valid.addmm_(grad_logits.t().to(grad_weight.dtype), hidden[rows].to(grad_weight.dtype))
        if ctx.tp_group is not None and dist.get_world_size(ctx.tp_group) > 1:
            dist.all_reduce(grad_hidden, group=ctx.tp_group)
        return grad_hidden, grad_weight.to(weight.dtype), *none
