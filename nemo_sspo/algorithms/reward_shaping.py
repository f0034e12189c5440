"""Reward shaping terms added to the task reward before advantages are computed."""

from __future__ import annotations

import torch


def overlong_reward_shaping(
    lengths: torch.Tensor, max_len: int, cache_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), scaled by ``penalty``.

    With L_max = ``max_len`` and L_cache = ``cache_len``::

        R(|y|) = 0                                        if |y| <= L_max - L_cache
               = penalty * ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
               = -penalty                                 if |y| > L_max

    (``penalty = 1`` is the paper's term.) Add the result to the task reward.

    Args:
        lengths: ``[B]`` integer or float response lengths in tokens.
        max_len: L_max, >= 1.
        cache_len: L_cache, the soft-punishment interval, 1 <= cache_len <= max_len.
        penalty: magnitude of the full punishment, >= 0.

    Returns:
        ``[B]`` float32, values in ``[-penalty, 0]``.

    Raises:
        ValueError: lengths not 1-D or negative, or a bad ``max_len`` / ``cache_len`` / ``penalty``.
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
    if not isinstance(cache_len, int) or not 1 <= cache_len <= max_len:
        raise ValueError(f"cache_len must be an int in [1, max_len={max_len}], got {cache_len!r}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    length = lengths.to(torch.float64)
    if lengths.numel() and bool((length < 0).any()):
        raise ValueError("lengths must be >= 0")
    start = max_len - cache_len
    # (start - |y|) / cache_len runs from 0 at start to -1 at max_len; beyond max_len it is -1.
    ramp = ((start - length) / cache_len).clamp(min=-1.0, max=0.0)
    return (penalty * ramp).to(torch.float32)
