"""Per-step statistics of a rollout as metric (sum, count) pairs: rewards, lengths, truncation,
dynamic-sampling rounds, and the gap between the rollout engine's and the trainer's log-probs."""

from __future__ import annotations

import torch

from nemo_sspo.algorithms import select_nonzero_variance_groups
from nemo_sspo.algorithms.batch import response_to_target_frame
from nemo_sspo.trainer.sampling import Rollout

__all__ = ["pair", "rollout_logprobs", "rollout_metric_sums"]


def pair(total: float, count: float) -> torch.Tensor:
    """A float32 ``[2]`` (sum, count) metric pair (``nemo_sspo.parallel.metrics``)."""
    return torch.tensor([total, count], dtype=torch.float32)


def rollout_logprobs(rollout: Rollout, batch) -> torch.Tensor:
    """The engine's log-probs of the sampled tokens in the batch's target frame, ``[B, S]`` float32
    (0 outside ``batch.loss_mask``)."""
    rb = rollout.batch
    return response_to_target_frame(rb.rollout_logprobs, rb.prompt_mask, batch.loss_mask.shape[1])


def rollout_metric_sums(rollout: Rollout, batch, cfg) -> dict[str, torch.Tensor]:
    """This data-parallel rank's rollout metrics.

    Args:
        rollout: the step's scored rollout.
        batch: its ``PolicyBatch`` with ``old_logprobs`` filled (last pipeline stage).
        cfg: the ``TrainConfig`` (``rollout.samples_per_prompt``, ``reward.overlong_buffer_len``).

    Returns:
        ``reward/mean``, ``reward/accuracy``, ``response/length_mean``, ``response/truncated_frac``,
        ``rollout/sampling_rounds``, ``rollout/kept_group_frac``, ``reward/shaped_mean`` (with
        overlong shaping) and ``rollout/trainer_logprob_gap_abs`` (mean |log pi_rollout - log pi_old|
        per response token) as float32 ``[2]`` pairs.
    """
    rb, task = rollout.batch, rollout.task_rewards
    n = float(task.numel())
    lengths = rb.response_mask.sum(dim=1).float()
    varied = select_nonzero_variance_groups(task, cfg.rollout.samples_per_prompt).num_nonzero_variance
    sums = {
        "reward/mean": pair(float(task.sum()), n),
        "reward/accuracy": pair(float((task >= 1.0).sum()), n),
        "response/length_mean": pair(float(lengths.sum()), n),
        "response/truncated_frac": pair(float(rb.truncated.float().sum()), n),
        # Each data-parallel rank reports the (common) round count once.
        "rollout/sampling_rounds": pair(float(rollout.rounds), 1.0),
        "rollout/kept_group_frac": pair(float(varied), float(rollout.generated_groups)),
    }
    if cfg.reward.overlong_buffer_len > 0:
        sums["reward/shaped_mean"] = pair(float(rollout.rewards.sum()), n)
    mask = batch.loss_mask
    if mask.any():
        gap = (rollout_logprobs(rollout, batch) - batch.old_logprobs)[mask].abs()
        sums["rollout/trainer_logprob_gap_abs"] = pair(float(gap.sum()), float(gap.numel()))
    return sums
