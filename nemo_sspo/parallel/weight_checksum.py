"""Exact checksums of weight tensors, for checking that a rollout engine holds what the trainer exported.

A tensor's checksum is two integers computed from its bytes, not from its values: the elements are
read as the signed integers of their own width (``int16`` for bf16/fp16, ``int32`` for fp32,
``int64`` for fp64/int64, ``uint8`` for 1-byte types), widened to int64, and

    s1 = sum_i x_i             s2 = sum_i (i + 1) * x_i        (both modulo 2^64)

Integer addition modulo 2^64 is associative, so the result does not depend on the reduction order
(CPU, GPU, chunking all give the same pair), unlike a float sum; reading the bytes makes it exact
(``-0.0`` and ``0.0``, or two NaN payloads, differ) and dtype-aware (the same values in bf16 and in
fp32 give different pairs: compare a tensor with the export cast to the tensor's dtype). ``s1``
changes whenever one element changes (the difference of two distinct values of one width is never
0 modulo 2^64); ``s2`` also changes when two different elements swap places. It is a check against
loading bugs (wrong tensor, stale layer, half-applied bucket, transposed or shifted copy), not a
cryptographic hash. Cost: a few passes over the tensor on its own device, in chunks of
:data:`CHUNK_ELEMENTS` elements (at most 3 int64 temporaries of that length), and nothing leaves the
device until the caller compares.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_ELEMENTS", "tensor_checksum", "tensors_checksums"]

CHUNK_ELEMENTS = 1 << 24
"""Elements per chunk of the checksum (3 x 128 MiB of int64 temporaries at most)."""
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The pair ``(s1, s2)`` of ``tensor`` (module docstring), on the tensor's device.

    Args:
        tensor: any shape and dtype of element width 1, 2, 4 or 8 bytes (bool, uint8, bf16, fp16,
            fp32, fp64, int32, int64, ...); read as its contiguous bytes in row-major order.

    Returns:
        ``[2]`` int64 on ``tensor.device``: the sums modulo 2^64 (as two's-complement int64).

    Raises:
        ValueError: an element width other than 1, 2, 4 or 8 bytes (complex types).
    """
    width = tensor.element_size()
    if width not in _INT_OF_WIDTH:
        raise ValueError(f"no checksum for dtype {tensor.dtype} ({width}-byte elements; widths 1, 2, 4, 8 only)")
    words = tensor.detach().contiguous().reshape(-1).view(_INT_OF_WIDTH[width])
    total = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    for start in range(0, words.numel(), CHUNK_ELEMENTS):
        chunk = words[start:start + CHUNK_ELEMENTS].to(torch.int64)
        positions = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=tensor.device)
        total[0] += chunk.sum()
        total[1] += (chunk * positions).sum()
    return total


def tensors_checksums(tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype] | None = None
                      ) -> torch.Tensor:
    """``[n, 2]`` int64 checksums of ``tensors`` in their order, each cast to ``dtypes[name]`` first.

    Args:
        tensors: name -> tensor (any devices; the result is on the first tensor's device).
        dtypes: name -> dtype the tensor is cast to before its bytes are read (the dtype the engine
            holds it in), or None to read each as it is.

    Returns:
        ``[n, 2]`` int64, row ``k`` the :func:`tensor_checksum` of the k-th tensor.

    Raises:
        ValueError: as :func:`tensor_checksum`; ``tensors`` is empty.
    """
    if not tensors:
        raise ValueError("tensors is empty: nothing to checksum")
    device = next(iter(tensors.values())).device
    rows = [tensor_checksum(t if dtypes is None else t.to(dtypes[name])).to(device) for name, t in tensors.items()]
    return torch.stack(rows)
