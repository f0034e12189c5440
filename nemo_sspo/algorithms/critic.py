"""SPPO's critic maths: sequence-level PPO (arXiv 2604.08865) with a scalar value of the prompt.

SPPO treats a whole response as one action of a contextual bandit: the baseline is a learned value
V(x) of the prompt x alone, so one sample per prompt is enough (no group baseline). With 0/1 rewards:

- prediction: p(x) = sigmoid(V(x)), an estimate of the probability that a response to x is right;
- critic loss (binary cross-entropy on the reward; prompt x with responses i = 1..G):
  L_V = mean over prompts of BCE(p(x), rbar(x)) = -[rbar log p + (1 - rbar) log(1 - p)], with
  rbar(x) the mean reward of x's responses (BCE is linear in the target, so this equals the mean of
  the per-response BCE terms; for G = 1, rbar = r);
- advantage: A_i = r_i - p(x_i), from the critic *before* its update on the batch, shared by every
  token of response i (the policy loss is the ``sppo`` ratio-clip loss).

The value model is ``nemo_sspo.megatron.value_model``; the trainer's component that runs it is
``nemo_sspo.trainer.critic_training``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["critic_advantages", "critic_loss", "critic_targets"]


def _check_group_size(group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1 (responses per prompt)")


def critic_targets(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """BCE target per prompt: the mean reward of its ``group_size`` consecutive responses.

    Args:
        rewards: ``[B]`` float, 0/1 task rewards (any value in [0, 1] is accepted).
        group_size: G responses per prompt; ``B % G == 0``.

    Returns:
        ``[B / G]`` float32.

    Raises:
        ValueError: ``group_size < 1``, ``B % G != 0``, or a reward outside [0, 1] or NaN (BCE
            needs a probability target).
    """
    _check_group_size(group_size)
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] with B divisible by group_size={group_size}")
    if bool((~((rewards >= 0) & (rewards <= 1))).any()):  # NaN fails both comparisons
        raise ValueError("the SPPO critic's BCE target needs rewards in [0, 1] (a 0/1 correctness reward); "
                         f"got values in [{float(rewards.min())}, {float(rewards.max())}]")
    return rewards.to(torch.float32).reshape(-1, group_size).mean(dim=1)


def critic_loss(value_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-prompt BCE of sigmoid(V) against the target, ``[n]`` float32 (module docstring).

    Args:
        value_logits: ``[n]`` V(x), the critic's logit (with grad).
        targets: ``[n]`` float in [0, 1].
    """
    return F.binary_cross_entropy_with_logits(value_logits.float(), targets.float(), reduction="none")


def critic_advantages(rewards: torch.Tensor, value_logits: torch.Tensor, group_size: int) -> torch.Tensor:
    """SPPO's advantage A_i = r_i - sigmoid(V(x_i)) per response.

    Args:
        rewards: ``[B]`` float, rows grouped by prompt (G consecutive rows per prompt).
        value_logits: ``[B / G]`` V(x) per prompt (no gradient is taken).
        group_size: G.

    Returns:
        ``[B]`` float32.

    Raises:
        ValueError: ``group_size < 1``, ``rewards`` not ``[B]``, or ``value_logits`` not
            ``[B / G]`` (one logit per group of G consecutive responses; no broadcasting).
    """
    _check_group_size(group_size)
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] with B divisible by "
                         f"group_size={group_size}")
    groups = rewards.numel() // group_size
    if tuple(value_logits.shape) != (groups,):
        raise ValueError(f"value_logits has shape {tuple(value_logits.shape)} but must be [B / G] = "
                         f"[{groups}] (one critic logit per prompt for rewards "
                         f"{tuple(rewards.shape)}, group_size={group_size})")
    baseline = torch.sigmoid(value_logits.detach().float()).repeat_interleave(group_size)
    return rewards.to(torch.float32) - baseline.to(rewards.device)
