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

Free-running (``rollout.staleness_schedule: free``, ``placement: separate`` only): the rollout rank
numbers its rollouts 1, 2, ... (the number seeds the rollout's prompts as a step would), generates
each with the newest weights it has, and the trainer takes them in that order. Step t accepts a
rollout when its lag ``(t - 1) - version <= k`` (:func:`is_fresh`), else drops it and takes the next.
:class:`FreeQueue` decides on the rollout rank when it may start another rollout: with
``stale_policy: wait`` it keeps at most k + 1 rollouts the trainer has not taken and none beyond the
last step, which makes every rollout fresh when it trains (nothing is dropped, rollout n trains at
step n); with ``drop`` it keeps up to 2 (k + 1) rollouts ahead that could still be fresh at the next
step (a memory bound, ours), whatever the trainer's progress, so stale ones get dropped.

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

__all__ = ["FreeQueue", "LockStepRollouts", "VersionedRollout", "dropped_sums", "is_fresh", "rollout_idle_s",
           "version_lag_sums"]


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


def is_fresh(version: int, step: int, max_staleness: int) -> bool:
    """Whether step ``step`` (starting from version ``step - 1``) may train on a rollout of ``version``.

    Args:
        version: updates behind the weights that generated the rollout.
        step: the step about to train (1-based).
        max_staleness: k (``rollout.max_staleness``).

    Returns:
        ``(step - 1) - version <= max_staleness``.
    """
    return step - 1 - version <= max_staleness


class FreeQueue:
    """The rollout rank's view of the free-running schedule (module docstring).

    Args:
        max_staleness: k >= 0.
        policy: ``wait`` or ``drop`` (``rollout.stale_policy``).
        last_step: ``trainer.max_steps``.
        done: steps already done (0, or a resumed run's step): the weights the rollout rank holds
            are version ``done`` and its rollouts are numbered from ``done + 1``.

    Attributes:
        version: updates behind the weights the rollout rank holds.
        sent: the number of the last rollout sent.
    """

    def __init__(self, max_staleness: int, policy: str, last_step: int, done: int) -> None:  # noqa: D107
        if policy not in ("wait", "drop"):
            raise ValueError(f"policy={policy!r} must be 'wait' or 'drop'")
        self.max_staleness, self.policy, self.last_step = max_staleness, policy, last_step
        self.version = self.sent = done
        self._pending: list[tuple[int, int]] = []  # (rollout number, version) sent but not known taken

    def record(self, version: int) -> int:
        """Counts a rollout about to be sent with ``version``; returns its number."""
        self.sent += 1
        self._pending.append((self.sent, version))
        return self.sent

    def take_notice(self, version: int, taken: int) -> int:
        """Takes a notice: the trainer holds ``version`` and has received ``taken`` rollouts.

        Returns:
            How many sent rollouts it has not received (their sends may still be running).
        """
        self.version = version
        self._pending = [(n, v) for n, v in self._pending if n > taken]
        return len(self._pending)

    def may_generate(self) -> bool:
        """Whether the next rollout may start now (else the rollout rank waits for the next notice).

        Only pending rollouts that can still be fresh when the next step (``version + 1``) trains them
        count against the bound: older ones will be dropped, so the rollout rank replaces them instead
        of idling while the trainer would wait for a fresh one. The trainer never starves: each step
        takes at least one rollout, so after each notice at least one more may start.
        """
        k = self.max_staleness
        could_train = sum(v >= self.version - k for _, v in self._pending)
        if self.policy == "wait":
            return could_train < k + 1 and self.sent < self.last_step
        return could_train < 2 * (k + 1)


def dropped_sums(dropped: int) -> dict[str, MetricPair]:
    """``rollout/dropped_share``: rollouts dropped / rollouts received in a step that trained on one.

    Args:
        dropped: rollouts this step dropped before the one it trains on.

    Returns:
        A ``"mean"`` pair (the same on every data-parallel rank, which all see the same rollouts).
    """
    return {"rollout/dropped_share": mean_pair(float(dropped), dropped + 1)}


def rollout_idle_s(windows: list[tuple[float, float]], previous_end: float | None) -> float:
    """The rollout rank's time between rollouts: waiting for the trainer and taking its weights.

    Args:
        windows: generation windows (unix seconds, start and end, measured on the rollout rank) of the
            rollouts a step received, in order.
        previous_end: end of the rollout received before them, or None for the run's first.

    Returns:
        Sum of each window's start minus the end before it (the first window's gap is 0 without a
        ``previous_end``).
    """
    idle, end = 0.0, previous_end
    for start, stop in windows:
        if end is not None:
            idle += max(0.0, start - end)
        end = stop
    return idle
