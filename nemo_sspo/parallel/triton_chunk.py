"""Triton kernels for the per-chunk work of the vocab-parallel log-prob/entropy reduction.

The torch path of :mod:`nemo_sspo.parallel.vocab_parallel` makes several elementwise passes over
each block of logits (subtract, scale, clamp, exp, multiply, sum). On CUDA these kernels do the
same work reading each logit once per pass of the algorithm:

- forward, :func:`chunk_local_stats`: one program per row walks the row's valid columns in
  tiles, keeping an online-softmax state (Milakov & Gimelshein 2018, "Online normalizer
  calculation for softmax", arXiv 1805.02867) extended to the entropy sum ``S1``;
- backward, :func:`write_block_grad`: one program per (row, tile) writes ``p (c1 log p + c0)``
  straight into the gradient tensor, in its dtype, with one rounding.

The maths (``z = logits / tau``, ``S0``, ``S1``, the gradient coefficients, the ``-inf`` floor)
is in ``vocab_parallel``'s module docstring; each kernel equals one torch helper there
(``_local_stats`` and ``_block_grad``) up to the order of floating-point sums.

This module imports triton at its top, so nothing imports it at package import time:
``vocab_parallel`` imports it inside the functions that call the kernels, and only when
``vocab_parallel.use_triton`` selects them (triton is optional: a CUDA torch brings its own).
Triton's interpreter (``TRITON_INTERPRET=1``, read when ``@triton.jit`` decorates, i.e. when this
module is first imported) runs the same kernels on CPU tensors; the unit tests use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chunk_local_stats", "write_block_grad"]

# Same value and reason as vocab_parallel._LOG_FLOOR (exp(-1e4) is 0 even in fp64; -1e4 times a
# gradient coefficient stays finite, so -inf logits give exact zeros without 0 * inf = NaN).
# A jit function may only read module globals declared constexpr.
_LOG_FLOOR = tl.constexpr(-1.0e4)
# Columns per tile on a GPU: 4096 bf16 logits are 16 per thread of 8 warps (wide vector loads);
# a row of V_local = 75,968 (Qwen2.5 at TP 2) is 19 tiles.
_MAX_TILE = 4096
# enable_fp_fusion=True is Triton's default, passed explicitly because Triton 3.9 warns when it is
# left unset; fused multiply-adds only remove roundings.
_LAUNCH = {"num_warps": 8, "enable_fp_fusion": True}
_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


# Reductions go through tl.reduce with these combine functions rather than tl.sum / tl.max (the
# same thing on a GPU): triton's own jit helpers are bound to compiled or interpreted mode when
# triton is imported, these when this module is, so importing this module under
# TRITON_INTERPRET=1 interprets the kernels even if triton was imported before (as in a full test
# run).
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _floored(value):
    # Not tl.maximum: its default (propagate_nan=NONE) may return the other operand for a NaN on a
    # GPU, and a NaN logit must stay NaN so that the caller's non-finite output check sees it.
    return tl.where(value < _LOG_FLOOR, _LOG_FLOOR, value)


@triton.jit
def _local_stats_kernel(x_ptr, out_ptr, inv_temp_ptr, n_cols, stride_row, stride_col,
                        ACC: tl.constexpr, LOWEST: tl.constexpr, TILE: tl.constexpr):
    """Row ``program_id(0)``: ``out[row] = (c, S0, S1)`` relative to ``m = c * inv_temp``."""
    row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 past 2^31 elements
    inv_temp = tl.load(inv_temp_ptr)
    row_ptr = x_ptr + row * stride_row
    offsets = tl.arange(0, TILE)
    # Starting at the lowest finite value is the torch path's clamp: a row of only -inf keeps
    # c = LOWEST and zero sums instead of (-inf) - (-inf) = NaN.
    raw_max = tl.full([], LOWEST, ACC)
    sum_exp = tl.full([], 0.0, ACC)
    sum_exp_shifted = tl.full([], 0.0, ACC)
    for start in range(0, n_cols, TILE):
        cols = start + offsets
        x = tl.load(row_ptr + cols * stride_col, mask=cols < n_cols, other=float("-inf")).to(ACC)
        new_max = tl.maximum(raw_max, tl.reduce(x, 0, _max))
        # Re-base the running sums from the old max to the new one (identity in the docstring of
        # vocab_parallel.chunk_statistics): k = e^delta, S1 <- k (S1 + delta S0), S0 <- k S0.
        delta = _floored((raw_max - new_max) * inv_temp)
        scale = tl.exp(delta)
        shifted = _floored((x - new_max) * inv_temp)  # shift before scaling, as the torch path
        weights = tl.exp(shifted)
        sum_exp_shifted = scale * (sum_exp_shifted + delta * sum_exp) + tl.reduce(
            weights * shifted, 0, _add)
        sum_exp = scale * sum_exp + tl.reduce(weights, 0, _add)
        raw_max = new_max
    out = out_ptr + row * 3
    tl.store(out, raw_max)
    tl.store(out + 1, sum_exp)
    tl.store(out + 2, sum_exp_shifted)


@triton.jit
def _block_grad_kernel(x_ptr, columns_ptr, inv_temp_ptr, grad_ptr, n_cols, stride_row,
                       stride_col, grad_stride_row, grad_stride_col,
                       HAS_C1: tl.constexpr, ACC: tl.constexpr, TILE: tl.constexpr):
    """Row ``program_id(0)``, tile ``program_id(1)``: ``grad = p (c1 log p + c0)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = cols < n_cols
    inv_temp = tl.load(inv_temp_ptr)
    coefficients = columns_ptr + row * 4  # (c, log S0, c1, c0)
    raw_max = tl.load(coefficients)
    log_sum_exp = tl.load(coefficients + 1)
    x = tl.load(x_ptr + row * stride_row + cols * stride_col, mask=mask, other=0.0).to(ACC)
    log_p = _floored((x - raw_max) * inv_temp - log_sum_exp)
    if HAS_C1:
        grad = tl.exp(log_p) * (log_p * tl.load(coefficients + 2) + tl.load(coefficients + 3))
    else:
        grad = tl.exp(log_p) * tl.load(coefficients + 3)
    out = grad_ptr + row * grad_stride_row + cols * grad_stride_col
    tl.store(out, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _tile(n_cols: int, tile: int | None) -> int:
    if tile is None:
        return min(_MAX_TILE, max(16, triton.next_power_of_2(n_cols)))
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two, got {tile}")
    return tile


def _check_column_offsets(*tensors: torch.Tensor) -> None:
    """Column offsets ``col * stride`` are int32 in the kernels (only the row offset is widened):
    refuse a layout where they would overflow rather than read the wrong memory.
    """
    for t in tensors:
        if (t.shape[1] - 1) * abs(t.stride(1)) >= 2**31:
            raise ValueError(f"a [rows, {t.shape[1]}] tensor with column stride {t.stride(1)} has "
                             "column offsets past 2^31 elements; pass it with contiguous rows "
                             "(.contiguous())")


def _scalar(value: float, acc: torch.dtype, device: torch.device) -> torch.Tensor:
    # In a tensor, not a kernel argument: triton passes Python floats as fp32, which would round
    # 1 / tau for fp64 inputs.
    return torch.full((1,), value, dtype=acc, device=device)


def chunk_local_stats(block: torch.Tensor, inv_temp: float, acc: torch.dtype, *,
                      tile: int | None = None) -> torch.Tensor:
    """``[rows, 3]`` per-row ``(c, S0, S1)`` of one chunk, reading every logit once.

    Equals ``vocab_parallel._local_stats(block, inv_temp, acc)``: ``c`` = the row's raw max
    (``finfo(acc).min`` for a row of only ``-inf``), ``S0 = sum exp(z - m)``,
    ``S1 = sum exp(z - m) (z - m)`` with ``z = block / tau``, ``m = c / tau`` and exponents floored
    at ``-1e4`` (``-inf`` logits add exact zeros). Computed online, one tile of columns at a time.

    Args:
        block: ``[rows, n_valid]`` bf16/fp16/fp32/fp64 raw logits (any row stride, column offsets below 2^31; padding columns
            already sliced off), on CUDA, or on CPU under ``TRITON_INTERPRET=1``. Never written.
        inv_temp: ``1 / tau``.
        acc: accumulation dtype, fp32 (fp64 for fp64 input).
        tile: columns per tile, a power of two; default the next one above ``n_valid``, within
            ``[16, 4096]``.

    Returns:
        ``[rows, 3]`` tensor of dtype ``acc`` on ``block``'s device.

    Raises:
        ValueError: ``acc`` not fp32/fp64, ``tile`` not a power of two, or a column stride
            whose offsets pass 2^31 elements.
    """
    if acc not in _TL_DTYPES:
        raise ValueError(f"acc must be torch.float32 or torch.float64, got {acc}")
    _check_column_offsets(block)
    rows, n_cols = block.shape
    out = torch.empty(rows, 3, dtype=acc, device=block.device)
    if rows == 0:
        return out
    _local_stats_kernel[(rows,)](
        block, out, _scalar(inv_temp, acc, block.device), n_cols, block.stride(0),
        block.stride(1), ACC=_TL_DTYPES[acc], LOWEST=torch.finfo(acc).min,
        TILE=_tile(n_cols, tile), **_LAUNCH)
    return out


def write_block_grad(block: torch.Tensor, columns: torch.Tensor, has_c1: bool, inv_temp: float,
                     grad: torch.Tensor, *, tile: int | None = None) -> None:
    """Write ``grad = p (c1 log p + c0)`` (``p c0`` without ``c1``), reading every logit once.

    Equals ``grad.copy_(vocab_parallel._block_grad(block, columns, has_c1, inv_temp, acc))`` with
    ``log p = (block - c) / tau - log S0`` floored at ``-1e4`` (``-inf`` logits: gradient 0), in
    ``columns``' precision, rounded once to ``grad``'s dtype. The target column is not special
    here (``vocab_parallel._set_target_entries`` adds its term afterwards).

    Args:
        block: ``[rows, n_valid]`` raw logits (any row stride, column offsets below 2^31), on CUDA, or on CPU under
            ``TRITON_INTERPRET=1``. Never written.
        columns: ``[rows, 4]`` ``(c, log S0, c1, c0)`` per row in the accumulation dtype (fp32,
            fp64 for fp64 input); column 2 is not read when ``has_c1`` is False.
        has_c1: whether there is an entropy gradient (``c1 != 0``).
        inv_temp: ``1 / tau``.
        grad: ``[rows, n_valid]`` output (strides as ``block``'s, e.g. a column slice of the full gradient),
            same device; written in its own dtype.
        tile: columns per tile, a power of two; default the next one above ``n_valid``, within
            ``[16, 4096]``.

    Raises:
        ValueError: shapes that do not match, ``columns`` not fp32/fp64, ``tile`` not a power
            of two, or a column stride whose offsets pass 2^31 elements.
    """
    rows, n_cols = block.shape
    if grad.shape != block.shape or columns.shape != (rows, 4) or columns.dtype not in _TL_DTYPES:
        raise ValueError(f"need block and grad [rows, n_valid] and fp32/fp64 columns [rows, 4], got "
                         f"{tuple(block.shape)}, {tuple(grad.shape)}, {tuple(columns.shape)} "
                         f"{columns.dtype}")
    _check_column_offsets(block, grad)
    if rows == 0 or n_cols == 0:
        return
    tile = _tile(n_cols, tile)
    grid = (rows, triton.cdiv(n_cols, tile))
    _block_grad_kernel[grid](
        block, columns.contiguous(), _scalar(inv_temp, columns.dtype, block.device), grad, n_cols,
        block.stride(0), block.stride(1), grad.stride(0), grad.stride(1), HAS_C1=has_c1,
        ACC=_TL_DTYPES[columns.dtype], TILE=tile, **_LAUNCH)
