"""Per-segment means: the building block of segment-level importance ratios.

SSPO eq. 9 (arXiv 2511.04256): s_ij = exp( (1/|y_ij|) * sum_{t in y_ij} d_t ), with the token
log-ratio d_t = log pi_theta(y_t) - log pi_old(y_t). The same mean with token segments gives the
GRPO ratio and with whole-row segments the GSPO sequence ratio (arXiv 2507.18071).
"""

from __future__ import annotations

import torch

from nemo_sspo.algorithms.cp_context import CPContext

LOG_RATIO_CLAMP = 20.0
"""|log-ratio| cap before exp in every loss and metric: exp(20) ~ 4.9e8 stays finite in float32
and bf16, so a runaway ratio gives finite losses and gradients (docs/pitfalls.md#p3)."""


def segment_mean(
    values: torch.Tensor, segment_ids: torch.Tensor, mask: torch.Tensor, *,
    cp: CPContext | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``values`` over each (row, segment), broadcast back to the segment's tokens.

    The mean is taken per (row, segment id), never per row: packed rows holding several sequences
    just give each sequence its own ids (docs/pitfalls.md#p2). It is the mean, not the sum, of the values
    (docs/pitfalls.md#p4). Differentiable in ``values``: every token of a segment receives 1/|segment| of the
    segment's upstream gradient.

    Args:
        values: ``[B, T]`` float (e.g. token log-ratios). Masked positions may hold anything,
            including inf/NaN padding; they are never read.
        segment_ids: ``[B, T]`` int64, ids of valid tokens in ``[0, T)`` (as produced by
            :mod:`nemo_sspo.algorithms.segmentation`); masked positions are ignored. Ids are not
            range-checked here, to keep the loss free of host syncs.
        mask: ``[B, T]`` bool, True at valid tokens.
        cp: under context parallelism, this rank's share of the sequence
            (:class:`nemo_sspo.algorithms.cp_context.CPContext`): ``T`` is then the local
            width ``S_local``, ids lie in ``[0, cp.width)``, and the per-(row, segment) sums and
            counts are summed over the CP group (one all-reduce, differentiable) before the mean,
            so a segment split over ranks gets one mean, the CP = 1 one (ours). None: one process.

    Returns:
        ``(mean_per_token, length_per_token)``, both ``[B, T]`` in ``values``' dtype promoted to at
        least float32: the segment mean and the segment's token count at each valid token, 0 at
        masked positions.

    Raises:
        ValueError: the three shapes differ or are not 2-D, or ``mask`` is not bool.
    """
    if values.dim() != 2 or values.shape != segment_ids.shape or values.shape != mask.shape:
        raise ValueError(
            f"values {tuple(values.shape)}, segment_ids {tuple(segment_ids.shape)} and mask "
            f"{tuple(mask.shape)} must all be [B, T] with the same shape"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be torch.bool, got {mask.dtype}")
    # Accumulate in >= float32 so long segments (3k tokens) keep exact counts and stable sums.
    dtype = torch.promote_types(values.dtype, torch.float32)
    rows, local_width = values.shape
    width = local_width if cp is None else cp.width
    # One bucket per (row, segment): row * T + segment id is unique because ids lie in [0, T).
    row_offset = torch.arange(rows, device=values.device).unsqueeze(1) * width
    bucket = (row_offset + segment_ids.clamp(min=0)).reshape(-1)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    # where (not multiply) so inf/NaN at masked positions cannot leak into a sum.
    masked_values = torch.where(mask, values.to(dtype), zero).reshape(-1)
    weights = mask.to(dtype).reshape(-1)
    sums = torch.zeros(rows * width, dtype=dtype, device=values.device).scatter_add(
        0, bucket, masked_values
    )
    counts = torch.zeros(rows * width, dtype=dtype, device=values.device).scatter_add(
        0, bucket, weights
    )
    if cp is not None:  # every rank's partial sums of a segment, one collective for both
        sums, counts = cp.sum(torch.stack([sums, counts])).unbind(0)
    length = counts.gather(0, bucket).reshape(rows, local_width)
    mean = sums.gather(0, bucket).reshape(rows, local_width) / length.clamp(min=1)
    return torch.where(mask, mean, zero), torch.where(mask, length, zero)
