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


def _check_samples_per_prompt(samples_per_prompt: int) -> None:
    if isinstance(samples_per_prompt, bool) or not isinstance(samples_per_prompt, int) or samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt={samples_per_prompt!r} must be an int >= 1 (responses per prompt)")


def critic_targets(rewards: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """BCE target per prompt: the mean reward of its ``samples_per_prompt`` consecutive responses.

    Args:
        rewards: ``[B]`` float, 0/1 task rewards (any value in [0, 1] is accepted).
        samples_per_prompt: G responses per prompt; ``B % G == 0``.

    Returns:
        ``[B / G]`` float32.

    Raises:
        ValueError: ``samples_per_prompt < 1``, ``B % G != 0``, or a reward outside [0, 1] or NaN (BCE
            needs a probability target).
    """
    _check_samples_per_prompt(samples_per_prompt)
    if rewards.dim() != 1 or rewards.numel() % samples_per_prompt:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] with B divisible by "
                         f"samples_per_prompt={samples_per_prompt}")
    if bool((~((rewards >= 0) & (rewards <= 1))).any()):  # NaN fails both comparisons
        raise ValueError("the SPPO critic's BCE target needs rewards in [0, 1] (a 0/1 correctness reward); "
                         f"got values in [{float(rewards.min())}, {float(rewards.max())}]")
    return rewards.to(torch.float32).reshape(-1, samples_per_prompt).mean(dim=1)


def critic_loss(value_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-prompt BCE of sigmoid(V) against the target, ``[n]`` float32 (module docstring).

    Args:
        value_logits: ``[n]`` V(x), the critic's logit (with grad).
        targets: ``[n]`` float in [0, 1].
    """
    return F.binary_cross_entropy_with_logits(value_logits.float(), targets.float(), reduction="none")


def critic_advantages(rewards: torch.Tensor, value_logits: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """SPPO's advantage A_i = r_i - sigmoid(V(x_i)) per response.

    Args:
        rewards: ``[B]`` float, rows grouped by prompt (G consecutive rows per prompt).
        value_logits: ``[B / G]`` V(x) per prompt (no gradient is taken).
        samples_per_prompt: G.

    Returns:
        ``[B]`` float32.

    Raises:
        ValueError: ``samples_per_prompt < 1``, ``rewards`` not ``[B]``, or ``value_logits`` not
            ``[B / G]`` (one logit per group of G consecutive responses; no broadcasting).
    """
    _check_samples_per_prompt(samples_per_prompt)
    if rewards.dim() != 1 or rewards.numel() % samples_per_prompt:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] with B divisible by "
                         f"samples_per_prompt={samples_per_prompt}")
    groups = rewards.numel() // samples_per_prompt
    if tuple(value_logits.shape) != (groups,):
        raise ValueError(f"value_logits has shape {tuple(value_logits.shape)} but must be [B / G] = "
                         f"[{groups}] (one critic logit per prompt for rewards "
                         f"{tuple(rewards.shape)}, samples_per_prompt={samples_per_prompt})")
    baseline = torch.sigmoid(value_logits.detach().float()).repeat_interleave(samples_per_prompt)
    return rewards.to(torch.float32) - baseline.to(rewards.device)
