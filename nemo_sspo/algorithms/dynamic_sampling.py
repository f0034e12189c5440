"""DAPO dynamic sampling's selection step (arXiv 2503.14476, section 3.2 and eq. 11).

DAPO over-samples prompts and keeps only groups whose rewards are not all equal, so that every
group in the batch carries a non-zero advantage: the constraint 0 < |{o_i : is_equivalent(a, o_i)}|
< G of eq. 11, generalised here to any scalar reward (a group is kept when its rewards differ).
The refill loop (sample more prompts until enough groups survive) is the trainer's; this module is
the pure selection it runs on each candidate batch.
"""

from __future__ import annotations

import torch

from nemo_sspo.algorithms.advantages import _accepts_group_size, _check_rewards, zero_variance_groups


@_accepts_group_size
def select_nonzero_variance_groups(rewards: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """The groups whose rewards are not all equal (DAPO dynamic sampling).

    Args:
        rewards: ``[B]`` float, one reward per response; rows grouped consecutively by prompt.
        samples_per_prompt: G, responses per prompt; ``B % G`` must be 0. G = 1 groups never have variance.

    Returns:
        ``[K]`` int64 ascending indices of the kept groups (group k owns rows
        ``k*G .. k*G + G - 1``); never a zero-variance group.

    Raises:
        ValueError: bad rewards or samples_per_prompt (as ``group_advantages``).
    """
    _check_rewards(rewards, samples_per_prompt, 0.0)
    # The same test as group_advantages, which gives these groups advantage 0.
    return torch.nonzero(~zero_variance_groups(rewards, samples_per_prompt)).flatten()
