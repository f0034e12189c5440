"""DAPO dynamic sampling's selection step (arXiv 2503.14476, section 3.2 and eq. 11).

DAPO over-samples prompts and keeps only groups whose rewards are not all equal, so that every
group in the batch carries a non-zero advantage: the constraint 0 < |{o_i : is_equivalent(a, o_i)}|
< G of eq. 11, generalised here to any scalar reward (a group is kept when its rewards differ).
The refill loop (sample more prompts until enough groups survive) is the trainer's; this module is
the pure selection it runs on each candidate batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_sspo.algorithms.advantages import _check_rewards, zero_variance_groups


class NotEnoughGroupsError(ValueError):
    """Fewer groups with reward variance than the batch needs (see ``select_nonzero_variance_groups``)."""


@dataclass(frozen=True)
class GroupSelection:
    """Result of :func:`select_nonzero_variance_groups`.

    Attributes:
        indices: ``[K]`` int64 ascending indices of the kept groups (group k owns rows
            ``k*G .. k*G + G - 1``), at most ``target_groups`` of them.
        num_groups: groups in the candidate batch.
        num_nonzero_variance: groups whose rewards are not all equal (>= K).
        enough: True when ``target_groups`` is None or ``num_nonzero_variance >= target_groups``.
    """

    indices: torch.Tensor
    num_groups: int
    num_nonzero_variance: int
    enough: bool

    def rows(self, group_size: int) -> torch.Tensor:
        """``[K * G]`` int64 row indices of the kept groups, in order (to index rollout tensors)."""
        offsets = torch.arange(group_size, device=self.indices.device)
        return (self.indices.unsqueeze(1) * group_size + offsets).reshape(-1)


def select_nonzero_variance_groups(
    rewards: torch.Tensor,
    group_size: int,
    *,
    target_groups: int | None = None,
    strict: bool = False,
) -> GroupSelection:
    """Keep the groups whose rewards are not all equal (DAPO dynamic sampling).

    Args:
        rewards: ``[B]`` float, one reward per response; rows grouped consecutively by prompt.
        group_size: G, responses per prompt; ``B % G`` must be 0. G = 1 groups never have variance.
        target_groups: groups the training batch needs; the first ``target_groups`` kept groups
            are returned. None keeps them all.
        strict: raise :class:`NotEnoughGroupsError` instead of returning ``enough=False``.

    Returns:
        :class:`GroupSelection`; its ``indices`` never contain a zero-variance group.

    Raises:
        ValueError: bad rewards/group size (as ``group_advantages``), ``target_groups < 1``.
        NotEnoughGroupsError: ``strict`` and fewer than ``target_groups`` groups have variance; the
            message says how many did and what to change.
    """
    _check_rewards(rewards, group_size, 0.0)
    if target_groups is not None and (not isinstance(target_groups, int) or target_groups < 1):
        raise ValueError(f"target_groups must be a positive int or None, got {target_groups!r}")
    # The same test as group_advantages, which gives these groups advantage 0.
    nonzero = ~zero_variance_groups(rewards, group_size)
    kept = torch.nonzero(nonzero).flatten()
    count = int(kept.numel())
    enough = target_groups is None or count >= target_groups
    if not enough and strict:
        raise NotEnoughGroupsError(
            f"only {count} of {nonzero.numel()} groups have non-zero reward variance but "
            f"target_groups={target_groups}; sample more prompts before selecting (DAPO refills "
            "the batch), raise the group size, or lower target_groups"
        )
    if target_groups is not None:
        kept = kept[:target_groups]
    return GroupSelection(kept, int(nonzero.numel()), count, enough)
