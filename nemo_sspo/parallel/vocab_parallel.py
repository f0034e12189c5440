"""Fused vocab-parallel token log-probs and entropies from tensor-parallel logit shards.

Under Megatron tensor parallelism the output layer's logits are sharded along the vocabulary:
rank ``r`` holds ``logits [N, V_local]`` for the global token ids
``[vocab_start, vocab_start + V_local)``. SSPO needs, per token, the log-probability of the
sampled token and the entropy of the full-vocabulary distribution (arXiv 2511.04256, eq. 12).
Both are computed here without gathering the vocabulary.

Maths, in the scaled logits ``z = logits / tau`` (``tau`` = sampling temperature), with the
global max ``m``, ``S0 = sum_v exp(z_v - m)`` and ``S1 = sum_v exp(z_v - m) (z_v - m)``
(each a sum of per-shard partial sums, so one all-reduce SUM gives both)::

    log Z   = m + log S0
    log p_t = (z_t - m) - log S0                     (t = target id)
    H       = -sum_v p_v log p_v = log S0 - S1 / S0   (since log p_v = (z_v - m) - log S0)

Gradients (derivation, writing ``E[z] = sum_u p_u z_u``):

- ``d log p_t / d z_v = 1[v = t] - p_v`` because ``d log Z / d z_v = p_v``.
- ``H = log Z - E[z]`` and ``d E[z] / d z_v = p_v + sum_u z_u p_u (1[u = v] - p_v)
  = p_v + p_v (z_v - E[z])``, so ``d H / d z_v = p_v - p_v - p_v (z_v - E[z])
  = -p_v (log p_v + H)`` (using ``z_v - E[z] = log p_v + H``).
- ``d z / d logits = 1 / tau``.

Every term is local to the shard once the per-token ``log Z`` and ``H`` are known, so the
backward pass recomputes ``p`` from the saved input and needs no communication. Padding
columns (global id >= the true vocabulary size) are excluded from every sum: probability 0,
gradient 0.

Forward per chunk of tokens: each rank sums its shard relative to its own max ``m_r`` (one
sweep, in cache-sized row blocks on CPU), then one all-reduce MAX gives ``m`` and the partial
sums are re-based by ``exp(m_r - m)`` before one all-reduce SUM of ``[S0, S1, z_t - m]``. On CUDA
the per-chunk sweeps (the local sums here, ``p (c1 log p + c0)`` in the backward) run in Triton
kernels that read each logit once per pass (:mod:`nemo_sspo.parallel.triton_chunk`; the choice
and its ``NEMO_SSPO_TRITON`` switch are in :func:`use_triton`).
``-inf`` logits (how hosts mask unused ids) mean probability 0: they add nothing to either sum,
contribute 0 to the entropy and get a zero gradient. Exponents are floored at ``_LOG_FLOOR``
(far below where ``exp`` underflows to 0 in fp64) so that ``0 * (-inf)`` never turns into NaN;
the floor changes no finite result. NaN or ``+inf`` logits, a row whose every logit is ``-inf``
and a target whose logit is ``-inf`` make some per-token output non-finite; that is detected on
the ``[N]`` outputs (not by a second pass over the logits) and raised as ``ValueError``.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.distributed as dist

__all__ = ["use_triton", "vocab_parallel_logprobs_entropy", "vocab_shard_range"]

# CPU only: rows per compute block are picked so one fp32 block (~1 MiB) stays in the L2 cache,
# which makes the several elementwise passes per block cost about one pass over memory.
# On accelerators a whole communication chunk is one block (fewer, larger kernels).
_CPU_BLOCK_BYTES = 1 << 20
# exp(-1e4) is 0 in fp64 (underflow below about -745), and -1e4 times any gradient coefficient
# stays finite: flooring exponents here turns -inf logits into exact zeros without 0 * inf = NaN.
_LOG_FLOOR = -1.0e4


def vocab_shard_range(vocab_size_padded: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Global vocabulary ids ``[start, end)`` held by tensor-parallel rank ``tp_rank``.

    Megatron splits the padded vocabulary into ``tp_size`` equal contiguous shards.

    Args:
        vocab_size_padded: padded vocabulary size ``V_padded`` (rows of the output layer).
        tp_rank: this rank's index in the tensor-parallel group, ``0 <= tp_rank < tp_size``.
        tp_size: tensor-parallel world size, ``>= 1``.

    Returns:
        ``(start, end)`` with ``end - start = V_padded / tp_size = V_local``.

    Raises:
        ValueError: ``tp_size < 1``, ``tp_rank`` out of range, or ``vocab_size_padded`` not a
            positive multiple of ``tp_size`` (pad the vocabulary to a multiple of ``tp_size``).
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if vocab_size_padded < 1 or vocab_size_padded % tp_size:
        raise ValueError(
            f"vocab_size_padded={vocab_size_padded} must be a positive multiple of "
            f"tp_size={tp_size}; pad the vocabulary as Megatron does"
        )
    v_local = vocab_size_padded // tp_size
    return tp_rank * v_local, (tp_rank + 1) * v_local


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_size: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of the target and full-vocabulary entropy from a vocab shard.

    ``p = softmax(logits_full / temperature)`` over the true vocabulary;
    ``logprobs[i] = log p_i(targets[i])``; ``entropy[i] = -sum_v p_i(v) log p_i(v)``
    (SSPO token entropy, arXiv 2511.04256 eq. 12). Forward per chunk of tokens: one
    all-reduce MAX ``[chunk]`` and one all-reduce SUM ``[chunk, 3]`` on ``tp_group``; backward
    has no communication. Peak extra memory is ``O(chunk_size * V_local)`` (on CPU, one
    cache-sized block of rows); the input is never modified.

    Args:
        logits: ``[N, V_local]`` float (bf16/fp16/fp32/fp64), this rank's contiguous shard covering
            global ids ``[vocab_start, vocab_start + V_local)``. ``-inf`` marks an id with
            probability 0; NaN and ``+inf`` are refused.
        targets: ``[N]`` int64 global token ids in ``[0, vocab_size)``. Shifting (the token at
            position ``t + 1`` is the target of the logits at ``t``) is the caller's job.
        tp_group: tensor-parallel process group, or ``None`` for a single process (no
            communication). Never read from Megatron's global state.
        vocab_start: global id of this shard's first column; must be Megatron's contiguous equal
            split, ``vocab_start == tp_rank * V_local`` with ``V_local * tp_size >= vocab_size``
            (checked against the group's rank and size, without communication).
        vocab_size: true vocabulary size ``V``; shard columns with global id ``>= V`` are
            Megatron's padding and get probability 0.
        temperature: sampling temperature ``tau > 0``; logits are divided by it.
        chunk_size: tokens per communication chunk, ``>= 1``.

    Returns:
        ``(logprobs [N], entropy [N])`` in nats, fp32 (fp64 for fp64 input), identical on every
        rank of ``tp_group``, both differentiable w.r.t. ``logits`` (gradient in its dtype).

    Raises:
        ValueError: wrong shapes/dtypes/devices, non-positive temperature/chunk_size/vocab_size,
            a shard whose start or width does not fit the group's contiguous equal split
            (``tp_group=None``: the shard must be the whole vocabulary), negative vocab_start, a
            target outside ``[0, vocab_size)``, or a non-finite output (NaN/``+inf`` logits, a
            row of only ``-inf``, a target with logit ``-inf``). The target check and the
            non-finite check each cost one device-to-host sync per call.
    """
    check_arguments(logits, targets, vocab_start, vocab_size, temperature, chunk_size)
    layout_error = shard_layout_error(logits.shape[1], tp_group, vocab_start, vocab_size)
    if layout_error is not None and (tp_group is None or logits.shape[0] == 0):
        raise ValueError(layout_error)  # no collective would follow: nobody is left waiting
    return _VocabParallelLogprobsEntropy.apply(
        logits, targets, tp_group, vocab_start, vocab_size, float(temperature), int(chunk_size),
        layout_error,
    )


def check_arguments(logits, targets, vocab_start, vocab_size, temperature, chunk_size):
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a 2-D float tensor [N, V_local], got shape {tuple(logits.shape)} "
            f"dtype {logits.dtype}; flatten batch/sequence dims first"
        )
    check_targets_and_settings(targets, logits.shape[0], logits.device, vocab_start, vocab_size,
                               temperature, chunk_size)


def check_targets_and_settings(targets, rows, device, vocab_start, vocab_size, temperature,
                               chunk_size) -> None:
    """Checks shared with the fused output layer: targets ``[rows]`` int64 in range on
    ``device``, and the scalar settings.

    Raises:
        ValueError: naming the argument.
    """
    if targets.dim() != 1 or targets.dtype != torch.int64 or targets.numel() != rows:
        raise ValueError(
            f"targets must be int64 [N] with N={rows} (rows of the input), got shape "
            f"{tuple(targets.shape)} dtype {targets.dtype}"
        )
    if targets.device != device:
        raise ValueError(f"targets on {targets.device} but the input on {device}; move them")
    if vocab_size < 1 or vocab_start < 0:
        raise ValueError(
            f"need vocab_size >= 1 and vocab_start >= 0, got vocab_size={vocab_size}, "
            f"vocab_start={vocab_start}"
        )
    if not (temperature > 0 and temperature != float("inf")):
        raise ValueError(f"temperature must be a finite positive number, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets.numel() and bool(((targets < 0) | (targets >= vocab_size)).any()):
        raise ValueError(
            f"targets must be global token ids in [0, vocab_size={vocab_size}); "
            "replace ignore-index/padding values with a valid id and mask the loss instead"
        )


def shard_layout_error(v_local: int, tp_group, vocab_start: int, vocab_size: int) -> str | None:
    """Why the shard is not this rank's piece of Megatron's contiguous equal split, or None.

    Rank and size come from the group object (no collective). A full-vocabulary tensor passed
    with a sharded ``vocab_start`` is the typical mistake: it would give silently wrong sums.
    Rank 0 cannot see that mistake locally (its full tensor looks like a padded shard), so a
    rank that finds an error still joins the forward's two collectives and poisons its sums with
    NaN: every rank then fails the output check together instead of hanging in a collective.
    """
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    if vocab_start == tp_rank * v_local and v_local * tp_size >= vocab_size:
        return None
    return (
        f"logits shard [N, {v_local}] at vocab_start={vocab_start} is not rank {tp_rank}'s "
        f"piece of the contiguous equal split of vocab_size={vocab_size} over tp_group of "
        f"size {tp_size} (tp_group=None: one process): expected vocab_start="
        f"{tp_rank * v_local} and V_local >= {-(-vocab_size // tp_size)}; pass this rank's own "
        "shard of the output layer (not gathered logits), its vocab_start and its group"
    )


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the per-chunk sweeps over ``tensor`` run in the Triton kernels or in torch.

    The one place that chooses. ``NEMO_SSPO_TRITON`` (read at every call) says:

    - unset, empty or ``auto``: the kernels for CUDA tensors when triton is installed (a CUDA
      torch brings it); the torch path otherwise (on CPU it is tuned for the caches);
    - ``0``: the torch path everywhere (A/B comparisons, ``tests/gpu/gpu_checks.py fused``);
    - ``1``: the kernels for every tensor. A CPU tensor then needs Triton's interpreter
      (``TRITON_INTERPRET=1`` set before ``nemo_sspo.parallel.triton_chunk`` is first imported),
      which is how the unit tests run the kernels without a GPU.

    Raises:
        ValueError: another value, or ``1`` without triton or for a CPU tensor without
            ``TRITON_INTERPRET``.
    """
    choice = os.environ.get("NEMO_SSPO_TRITON", "") or "auto"
    if choice == "0":
        return False
    if choice == "auto":
        return tensor.is_cuda and _triton_installed()
    if choice != "1":
        raise ValueError(f"NEMO_SSPO_TRITON must be 0, 1 or auto (or unset), got {choice!r}")
    if not _triton_installed():
        raise ValueError("NEMO_SSPO_TRITON=1 but triton is not installed (pip install triton)")
    interpreted = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
    if not (tensor.is_cuda or interpreted):
        raise ValueError(f"NEMO_SSPO_TRITON=1 with a {tensor.device} tensor needs Triton's "
                         "interpreter: set TRITON_INTERPRET=1, or unset NEMO_SSPO_TRITON")
    return True


@functools.cache
def _triton_installed() -> bool:
    # find_spec, not import: importing triton costs about a second and is left to the first kernel.
    return importlib.util.find_spec("triton") is not None


def _block_rows(logits: torch.Tensor, n_cols: int, chunk: int) -> int:
    """Rows per compute block: the whole chunk on accelerators, a cache-sized block on CPU."""
    if logits.device.type != "cpu":
        return chunk
    return max(1, min(chunk, _CPU_BLOCK_BYTES // (4 * max(n_cols, 1))))


def _upcast_minus(block: torch.Tensor, column: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``block - column`` in ``acc`` precision as new memory (the input is never written).

    A copy then an in-place subtraction: a mixed-dtype ``torch.sub`` is ~10x slower on CPU.
    """
    if block.dtype == acc:
        return torch.sub(block, column)
    return block.to(acc).sub_(column)


def _local_stats(block: torch.Tensor, inv_temp: float, acc: torch.dtype) -> torch.Tensor:
    """``[rows, 3]``: raw local max ``c_r``, ``sum exp(z - m_r)``, ``sum exp(z - m_r) (z - m_r)``.

    ``block [rows, n_valid]`` holds raw logits (never written); ``z = block / tau`` and
    ``m_r = c_r / tau``. Sums use ``acc`` precision.
    """
    # A row of only -inf in this shard shifts by a finite base instead (its sums are then 0).
    raw_max = block.amax(dim=-1, keepdim=True).to(acc).clamp_min(torch.finfo(acc).min)
    # Shifting before scaling keeps z - m_r as exact as the input allows.
    shifted = _upcast_minus(block, raw_max, acc)
    if inv_temp != 1.0:
        shifted.mul_(inv_temp)
    shifted.clamp_min_(_LOG_FLOOR)  # -inf logits: weight exp(floor) = 0, weight * z = 0
    weights = torch.exp(shifted)
    sum_exp = weights.sum(dim=-1)
    sum_exp_shifted = weights.mul_(shifted).sum(dim=-1)
    return torch.stack([raw_max.squeeze(-1), sum_exp, sum_exp_shifted], dim=-1)


def _shard_partials(logits, n_valid, inv_temp, acc):
    """``[rows, 3]`` local statistics of one chunk: one Triton kernel over the chunk, or torch in
    cache-sized blocks of rows.
    """
    rows = logits.shape[0]
    if n_valid == 0:  # every column of this shard is padding: contributes nothing
        local = torch.zeros(rows, 3, dtype=acc, device=logits.device)
        local[:, 0] = float("-inf")
        return local
    valid = logits[:, :n_valid]
    if use_triton(logits):
        from nemo_sspo.parallel.triton_chunk import chunk_local_stats  # imports triton

        return chunk_local_stats(valid, inv_temp, acc)
    step = _block_rows(logits, n_valid, rows)
    blocks = [_local_stats(valid[s : s + step], inv_temp, acc) for s in range(0, rows, step)]
    return torch.cat(blocks)


def chunk_statistics(logits, targets, tp_group, vocab_start, n_valid, inv_temp, acc, poison):
    """Per token of one chunk: ``(logprobs, entropy, c, log S0)`` with ``c`` the global raw max.

    Two collectives: all-reduce MAX of ``c`` ``[rows]``, all-reduce SUM of ``[rows, 3]``.
    ``poison`` (a bad shard layout) makes this rank contribute NaN, so every rank's outputs fail.
    """
    local = _shard_partials(logits, n_valid, inv_temp, acc)
    raw_max = local[:, 0].clone()
    if tp_group is not None:
        dist.all_reduce(raw_max, op=dist.ReduceOp.MAX, group=tp_group)

    sums = torch.zeros_like(local)
    if n_valid:
        # Re-base partial sums from the local max m_r to the global max m (online-softmax
        # identity), so the block loop above runs before any communication:
        # sum e^(z-m) = k S0_r, sum e^(z-m)(z-m) = k (S1_r + (m_r - m) S0_r), k = e^(m_r - m).
        # Floored: a shard of only -inf has delta = -inf, and (-inf) * 0 would be NaN.
        delta = ((local[:, 0] - raw_max) * inv_temp).clamp_min(_LOG_FLOOR)
        scale = torch.exp(delta)
        sums[:, 0] = local[:, 1] * scale
        sums[:, 1] = (local[:, 2] + delta * local[:, 1]) * scale
        local_ids = targets - vocab_start
        owned = (local_ids >= 0) & (local_ids < n_valid)
        target_raw = logits.gather(1, local_ids.clamp(0, n_valid - 1).unsqueeze(-1)).squeeze(-1)
        target_shifted = (target_raw.to(acc) - raw_max) * inv_temp  # z_t - m
        sums[:, 2] = torch.where(owned, target_shifted, torch.zeros_like(target_shifted))
    if poison:
        sums.fill_(float("nan"))
    if tp_group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)

    log_sum_exp = sums[:, 0].log()
    logprobs = sums[:, 2] - log_sum_exp
    entropy = log_sum_exp - sums[:, 1] / sums[:, 0]
    return logprobs, entropy, raw_max, log_sum_exp


def _grad_coefficients(grad_logprobs, grad_entropy, entropy, inv_temp, acc):
    """Per-token ``(c1, c0)`` with ``dL/dlogits_v = p_v (c1 log p_v + c0)`` off the target.

    From ``d logp_t/dz_v = 1[v=t] - p_v`` and ``dH/dz_v = -p_v (log p_v + H)`` times ``1/tau``:
    ``c1 = -g_H / tau`` (``None`` without an entropy gradient), ``c0 = -(g_lp + g_H H) / tau``.
    A missing upstream gradient counts as zero.
    """
    # Out of place only: upstream gradients may be shared or expanded (stride-0) tensors.
    g_lp = torch.zeros_like(entropy) if grad_logprobs is None else grad_logprobs.to(acc)
    if grad_entropy is None:
        return None, g_lp * -inv_temp
    g_h = grad_entropy.to(acc)
    return g_h * -inv_temp, (g_lp + g_h * entropy) * -inv_temp


def _block_grad(block, columns, has_c1, inv_temp, acc):
    """``[rows, n_valid]`` gradient ``p (c1 log p + c0)`` w.r.t. raw logits (no target term).

    ``columns [rows, 4]`` = ``(c, log S0, c1, c0)`` per token; ``log p = (block - c)/tau - log S0``.
    """
    log_p = _upcast_minus(block, columns[:, 0:1], acc)
    if inv_temp != 1.0:
        log_p.mul_(inv_temp)
    log_p.sub_(columns[:, 1:2]).clamp_min_(_LOG_FLOOR)  # -inf logits: p = 0, gradient 0 (not NaN)
    grad = torch.exp(log_p)
    if not has_c1:
        return grad.mul_(columns[:, 3:4])
    return grad.mul_(log_p.mul_(columns[:, 2:3]).add_(columns[:, 3:4]))


def _set_target_entries(grad_logits, logprobs, targets, local_range, c1, c0, g_lp, inv_temp):
    """Write the target column ``p_t (c1 log p_t + c0) + g_lp / tau`` in one rounding.

    ``log p_t`` is the saved forward output. A masked gather/scatter (no ``nonzero``) keeps
    device and host unsynchronised.
    """
    vocab_start, n_valid = local_range
    local_ids = targets - vocab_start
    owned = (local_ids >= 0) & (local_ids < n_valid)
    # (row, column) pairs; rows without their target here rewrite their own current value.
    # Advanced indexing touches N entries (a CPU scatter_ on [N, V_local] copied the tensor).
    position = (torch.arange(len(targets), device=targets.device), local_ids.clamp(0, n_valid - 1))
    slope = logprobs * c1 if c1 is not None else torch.zeros_like(logprobs)
    value = logprobs.exp() * (slope + c0) + g_lp.to(logprobs.dtype) * inv_temp
    current = grad_logits[position]
    grad_logits[position] = torch.where(owned, value.to(current.dtype), current)


def check_finite_outputs(logits_row, targets, logprobs, entropy, vocab_start, n_valid,
                         layout_error):
    """Raises ``ValueError`` when a token's outputs are not finite (one host sync on ``[N]``).

    Every rank of the group reads the same all-reduced outputs, so all raise together (no rank
    is left waiting in a collective). Only on that error path is one row of the local shard
    read (``logits_row(i) -> [V_local]``), to say which input is at fault; this rank's own
    layout error comes first.
    """
    bad = ~(torch.isfinite(logprobs) & torch.isfinite(entropy))
    if not bool(bad.any()):
        return
    if layout_error is not None:
        raise ValueError(layout_error)
    rows = bad.nonzero().flatten()
    row = int(rows[0])
    shard_row = logits_row(row)[:n_valid]
    local_id = int(targets[row]) - vocab_start
    if bool(torch.isnan(shard_row).any()) or bool(torch.isposinf(shard_row).any()):
        cause = "its logits contain NaN or +inf on this rank's shard"
    elif 0 <= local_id < n_valid and bool(torch.isneginf(shard_row[local_id])):
        cause = f"its target id {int(targets[row])} has logit -inf (probability 0)"
    else:
        cause = ("its logits are NaN/+inf on another rank's shard, every logit is -inf, its "
                 "target's logit is -inf there, or another rank's shard does not fit the split")
    raise ValueError(
        f"non-finite log-prob/entropy for {rows.numel()} of {len(targets)} tokens; first at row "
        f"{row}: {cause}. -inf is allowed for ids with probability 0 (never the target); NaN "
        f"and +inf are not: check the model's output (overflow in low precision?) or the mask"
    )


def logits_gradient(logits, targets, stats, grad_logprobs, grad_entropy, meta) -> torch.Tensor:
    """``[N, V_local]`` gradient w.r.t. the raw logits shard, in its dtype (no communication).

    ``stats`` = ``(raw_max, log_sum_exp, entropy, logprobs)`` ``[N]`` saved by the forward,
    ``meta`` = ``(vocab_start, n_valid, inv_temp, chunk_size, acc)``. Shared by this module's
    backward and the fused output layer (``nemo_sspo.parallel.fused_output``), which calls it on
    one recomputed chunk of logits at a time.
    """
    raw_max, log_sum_exp, entropy, logprobs = stats
    vocab_start, n_valid, inv_temp, chunk_size, acc = meta
    c1, c0 = _grad_coefficients(grad_logprobs, grad_entropy, entropy, inv_temp, acc)
    zeros = torch.zeros_like(c0)
    columns = torch.stack([raw_max, log_sum_exp, zeros if c1 is None else c1, c0], dim=1)
    grad_logits = torch.empty_like(logits)
    grad_logits[:, n_valid:] = 0  # padding columns keep a zero gradient (and only they are zeroed)
    if n_valid == 0:
        return grad_logits
    valid = logits[:, :n_valid]
    if use_triton(logits):
        from nemo_sspo.parallel.triton_chunk import write_block_grad  # imports triton

        write_block_grad(valid, columns, c1 is not None, inv_temp, grad_logits[:, :n_valid])
    else:
        step = _block_rows(logits, n_valid, chunk_size)
        for s in range(0, logits.shape[0], step):
            rows = slice(s, s + step)
            block_grad = _block_grad(valid[rows], columns[rows], c1 is not None, inv_temp, acc)
            grad_logits[rows, :n_valid] = block_grad  # one rounding to the input dtype
    if grad_logprobs is not None:
        _set_target_entries(
            grad_logits, logprobs, targets, (vocab_start, n_valid), c1, c0, grad_logprobs, inv_temp,
        )
    return grad_logits


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    """Autograd function behind :func:`vocab_parallel_logprobs_entropy` (see module docstring)."""

    @staticmethod
    def forward(ctx, logits, targets, tp_group, vocab_start, vocab_size, temperature, chunk_size,
                layout_error):
        acc = torch.promote_types(logits.dtype, torch.float32)
        inv_temp = 1.0 / temperature
        n_valid = max(0, min(logits.shape[1], vocab_size - vocab_start))
        pieces = [
            chunk_statistics(
                logits[s : s + chunk_size], targets[s : s + chunk_size], tp_group, vocab_start,
                n_valid, inv_temp, acc, layout_error is not None,
            )
            for s in range(0, logits.shape[0], chunk_size)
        ]
        if pieces:
            logprobs, entropy, raw_max, log_sum_exp = (torch.cat(parts) for parts in zip(*pieces, strict=True))
        else:
            logprobs = entropy = raw_max = log_sum_exp = logits.new_zeros(0, dtype=acc)
        check_finite_outputs(lambda row: logits[row], targets, logprobs, entropy, vocab_start,
                             n_valid, layout_error)
        # Only per-token statistics are saved; backward recomputes p from the input.
        ctx.save_for_backward(logits, targets, raw_max, log_sum_exp, entropy, logprobs)
        ctx.meta = (vocab_start, n_valid, inv_temp, chunk_size, acc)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 8
        logits, targets, *stats = ctx.saved_tensors
        grad_logits = logits_gradient(logits, targets, stats, grad_logprobs, grad_entropy, ctx.meta)
        return grad_logits, None, None, None, None, None, None, None
