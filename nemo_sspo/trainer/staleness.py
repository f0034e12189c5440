"""Deterministic lock-step staleness: the rollout of step t comes from the weights of t - 1 - k.

With ``rollout.max_staleness = k`` the trainer keeps up to k + 1 steps' rollouts in flight. Step 1
generates the rollouts of steps 1 .. k + 1 with the initial weights (version 0); every later step t
generates the rollout of step t + k with the weights it starts from (version t - 1) and trains on the
rollout of step t, generated k steps earlier. The *version* of a sample is the number of updates
behind the weights that produced it; its *lag* at step t is ``(t - 1) - version`` = min(t - 1, k).
The loss's ratio pi_theta / pi_old uses pi_old recomputed at version t - 1, and
``rollout.correction`` weights the mu -> pi_old gap (:mod:`nemo_sspo.algorithms.off_policy`).

Every step's rollout still draws its prompts in step order with the seeds of
:func:`nemo_sspo.trainer.sampling.generation_seed` ``(seed, step, ...)``, so k changes which weights
sample a step's prompts, never which prompts. k = 0 is today's on-policy loop.

Resume: the queue is not checkpointed. A resumed run restores the data position of its last trained
step and regenerates from the resumed weights, so its first k steps have a smaller lag than an
uninterrupted run's (the trainer logs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nemo_sspo.metrics import MetricPair, max_pair, mean_pair
from nemo_sspo.trainer.sampling import Rollout

__all__ = ["LockStepRollouts", "VersionedRollout", "version_lag_sums"]


@dataclass(frozen=True)
class VersionedRollout:
    """A step's rollout with the policy version that generated it.

    Attributes:
        rollout: the scored rollout.
        version: updates behind the weights that generated it (0 = the initial weights).
        problems_drawn: the sampler's data position right after generating it (what a checkpoint
            taken once this rollout is trained must restore); 0 off generator ranks.
        generated: unix seconds (start, end) of its generation and scoring, on the rank that ran them.
    """

    rollout: Rollout
    version: int
    problems_drawn: int
    generated: tuple[float, float] = (0.0, 0.0)


class LockStepRollouts:
    """The rollouts in flight under lock-step staleness (module docstring).

    Args:
        max_staleness: k >= 0 (``rollout.max_staleness``).
        last_step: the run's last step (``trainer.max_steps``): nothing is generated beyond it.

    Raises:
        ValueError: ``max_staleness < 0``.
    """

    def __init__(self, max_staleness: int, last_step: int) -> None:  # noqa: D107 - documented on the class
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0")
        self.max_staleness, self.last_step = max_staleness, last_step
        self._pending: dict[int, VersionedRollout] = {}

    def take(self, step: int, generate: Callable[[int], VersionedRollout]) -> VersionedRollout:
        """The rollout step ``step`` trains on.

        First generates (with ``generate``, at the current weights) the rollouts of steps
        ``step .. step + k`` not yet in flight, in step order.

        Args:
            step: the step about to train (1-based).
            generate: ``generate(s)`` -> step s's rollout from the current weights (collective
                across the replica, as :meth:`nemo_sspo.trainer.loop.GRPOTrainer.generate_and_score`).

        Returns:
            The :class:`VersionedRollout` of ``step``; it leaves the queue.
        """
        for ahead in range(step, min(step + self.max_staleness, self.last_step) + 1):
            if ahead not in self._pending:
                self._pending[ahead] = generate(ahead)
        return self._pending.pop(step)


def version_lag_sums(versioned: VersionedRollout, step: int) -> dict[str, MetricPair]:
    """``rollout/version_lag_mean`` and ``rollout/version_lag_max`` over this rank's samples.

    The lag of a sample is the number of updates between the weights that generated it and those
    step ``step`` starts from.

    Args:
        versioned: the step's rollout and its version.
        step: the step training on it (1-based; it starts from version ``step - 1``).

    Returns:
        A ``"mean"`` and a ``"max"`` metric pair over the rollout's responses.
    """
    samples = versioned.rollout.rewards.numel()
    lags = torch.full((samples,), float(step - 1 - versioned.version))
    valid = torch.ones(samples, dtype=torch.bool)
    return {"rollout/version_lag_mean": mean_pair(lags.sum(), samples),
            "rollout/version_lag_max": max_pair(lags, valid)}
