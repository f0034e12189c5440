"""Megatron-Core's THD layout for one packed row: ``PackedSeqParams`` and the row's padded width.

A packed micro-batch (:class:`nemo_sspo.algorithms.micro_batches.MicroBatch` with
``sequence_lengths``) is one row of ``T = sum(lengths)`` tokens holding ``K`` sequences end to
end. With the TransformerEngine spec, ``GPTModel.forward`` takes it as ``input_ids [1, T]`` plus
``packed_seq_params`` (``qkv_format="thd"``) and no attention mask; every activation is then
``[T, 1, H]`` (``transformer/attention.py`` squeezes the batch dimension for TE's
``[T, heads, head_dim]`` and reshapes the output back to ``[T, 1, H]``), so it travels between
pipeline stages like an ordinary ``[S, B=1, H]`` tensor. What the Megatron-Core 0.16.1 source fixes:

- ``cu_seqlens_q`` / ``cu_seqlens_kv``: int32 ``[K + 1]`` on the GPU (TE's fused and flash
  attention read int32 offsets; ``models/common/embeddings/rope_utils.py`` documents "shape
  [b + 1] and dtype torch.int32").
- ``max_seqlen_q`` / ``max_seqlen_kv``: Python ints. ``RotaryEmbedding.get_rotary_seq_len``
  returns ``max(max_seqlen_q, max_seqlen_kv)`` as the rotary table's length
  (``rotary_pos_embedding.py``, 0.16.1 lines 238-241) and ``RotaryEmbedding.forward`` is
  ``lru_cache``-d on it, so it must be a hashable int, and at least every sequence's length.
- RoPE restarts at each sequence: ``_apply_rotary_pos_emb_thd`` (``rope_utils.py`` 178-247)
  splits the tokens at ``cu_seqlens`` and gives each sequence the table rows ``0..L_i - 1``, so
  each sequence sees the positions it would see alone (``position_ids`` are not read by a RoPE
  model's embedding).
- The attention module passes ``cu_seqlens_*_padded`` instead of ``cu_seqlens_*`` to RoPE when
  they are set (``transformer/attention.py`` 1081-1089); we never set them (below).

Trailing padding (:func:`thd_alignment`): FP8 GEMMs need the token count divisible by 16 (32 for
MXFP8; Megatron's ``fp8_utils.get_fp8_align_size``; TE asserts the product of the leading dims
divisible by 8 in forward, and the token dimension becomes a GEMM's inner dimension in the weight
gradient; NeMo-RL pads packed rows to 16, or 128 with blockwise scaling, for these). We pad the row
at its end and count the padding as part of the *last* sequence (``cu_seqlens[-1]`` = the padded
width), as NeMo-RL's Megatron packing does. Attention is causal, so no real token attends to the
padding after it; and the loss reads the model output only at ``MicroBatch.token_index``, which
never points past ``T``. This needs neither ``cu_seqlens_*_padded`` (TE >= 1.10 only) nor an extra
dummy sequence.

Context parallelism is refused: THD under CP needs every sequence padded to a multiple of
``2 * cp`` and split across the CP ranks (load-balanced halves), which nothing here does.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["packed_seq_params", "padded_width", "thd_alignment"]

BLOCKWISE_FP8_ALIGN = 128
"""Token alignment for ``fp8_recipe='blockwise'`` (128-wide scaling blocks; NeMo-RL's value).
Megatron-Core 0.16.1's ``get_fp8_align_size`` says 16 for it; the larger value is the safe one."""


def thd_alignment(config: Any) -> int:
    """Multiple the packed row's width is padded to under ``config`` (a ``TransformerConfig``).

    1 without FP8 or sequence parallelism; FP8: Megatron's ``get_fp8_align_size`` (16, MXFP8 32),
    blockwise :data:`BLOCKWISE_FP8_ALIGN`; times ``tensor_model_parallel_size`` with sequence
    parallelism (each TP rank holds ``T / tp`` tokens, so ``T`` must split evenly and each shard
    must be aligned).

    Raises:
        ValueError: ``context_parallel_size > 1`` (not handled, module docstring), naming it.
    """
    cp_size = getattr(config, "context_parallel_size", 1)
    if cp_size > 1:
        raise ValueError(f"packed sequences (parallel.pack_sequences=true) with context_parallel_size="
                         f"{cp_size} are not supported: THD under context parallelism needs each "
                         "sequence padded to 2 * cp and split across the CP ranks; set "
                         "parallel.pack_sequences=false")
    align = 1
    if getattr(config, "fp8", None):
        from megatron.core.fp8_utils import get_fp8_align_size

        recipe = config.fp8_recipe
        align = BLOCKWISE_FP8_ALIGN if recipe == "blockwise" else get_fp8_align_size(recipe)
    if getattr(config, "sequence_parallel", False):
        align *= config.tensor_model_parallel_size
    return align


def padded_width(width: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` (>= 1) that is >= ``width``."""
    return -(-width // alignment) * alignment


def packed_seq_params(sequence_lengths: torch.Tensor, device: torch.device | str, *,
                      total_length: int | None = None):
    """``PackedSeqParams`` (``qkv_format="thd"``) of one packed row.

    Args:
        sequence_lengths: ``[K]`` integer lengths of the sequences laid end to end, each >= 1.
        device: where the ``cu_seqlens`` tensors go (the row's device: TE reads them on the GPU).
        total_length: the row's width after trailing padding, >= ``sum(lengths)``; None for no
            padding. The padding is counted in the last sequence (module docstring).

    Returns:
        ``PackedSeqParams`` with ``cu_seqlens_q = cu_seqlens_kv`` = int32 ``[K + 1]``
        ``[0, L_0, L_0 + L_1, ..., total_length]``, ``max_seqlen_q = max_seqlen_kv`` = the largest
        (padded) length as a Python int, and no ``*_padded`` offsets or CP group. Example:
        lengths ``[2, 3, 4]`` -> cu_seqlens ``[0, 2, 5, 9]``, max_seqlen 4; with
        ``total_length=16`` -> ``[0, 2, 5, 16]``, max_seqlen 11.

    Raises:
        ValueError: no sequence, a length below 1 (TE's kernels take no empty sequence; every
            packed sequence holds at least its prompt), a non-1-D or non-integer tensor, or
            ``total_length`` below the sum.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if sequence_lengths.dim() != 1 or sequence_lengths.numel() == 0 or sequence_lengths.is_floating_point():
        raise ValueError(f"sequence_lengths must be a non-empty 1-D integer tensor, got shape "
                         f"{tuple(sequence_lengths.shape)} and dtype {sequence_lengths.dtype}")
    lengths = [int(length) for length in sequence_lengths.tolist()]
    if min(lengths) < 1:
        raise ValueError(f"sequence_lengths must all be >= 1 (an empty sequence has no tokens to "
                         f"pack), got {lengths}")
    total = sum(lengths)
    if total_length is not None:
        if total_length < total:
            raise ValueError(f"total_length={total_length} is below the packed tokens ({total})")
        lengths[-1] += total_length - total
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
