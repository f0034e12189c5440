"""Deterministic lock-step staleness: the rollout of step t comes from the weights of t - 1 - k.

With ``rollout.schedule.max_staleness = k`` the trainer keeps up to k + 1 steps' rollouts in flight. Step 1
generates the rollouts of steps 1 .. k + 1 with the initial weights (version 0); every later step t
generates the rollout of step t + k with the weights it starts from (version t - 1) and trains on the
rollout of step t, generated k steps earlier. The *version* of a sample is the number of updates
behind the weights that produced it; its *lag* at step t is ``(t - 1) - version`` = min(t - 1, k).
The loss's ratio pi_theta / pi_old uses pi_old recomputed at version t - 1, and
``rollout.correction.name`` weights the mu -> pi_old gap (:mod:`nemo_sspo.algorithms.off_policy`).

Every step's rollout still draws its prompts in step order with the seeds of
:func:`nemo_sspo.rollouts.sampling.generation_seed` ``(seed, step, ...)``, so k changes which weights
sample a step's prompts, never which prompts. k = 0 is today's on-policy loop.

Free-running (``rollout.schedule.mode: free``, ``placement: separate`` only) over R >= 1
rollout ranks: rollout rank j numbers its rollouts 1, 2, ... (its number n seeds the rollout's
prompts as step n would seed rank j's slots), generates each with the newest weights it has, and
each holds P / R prompt groups. Step t takes R rollouts in the order they arrive, from whichever
ranks sent them (:class:`~nemo_sspo.rollouts.collector.RolloutCollector`), so one step may mix
versions: every response carries its own (:attr:`VersionedRollout.sample_versions`). The bound holds
per response: step t trains a rollout only when every response's lag ``(t - 1) - version <= k``
(:func:`is_fresh` of its oldest), else drops it and takes the next to arrive.

:class:`FreeQueue` decides on each rollout rank when it may start another rollout: with
``stale_policy: wait`` it keeps at most k + 1 of its rollouts the trainer has not taken and none the
run cannot use. With one rollout rank that makes every rollout fresh when it trains (nothing is
dropped, rollout n trains at step n). With R > 1 the trainer takes rollouts in arrival order, so a
slow rank's rollout can still age past the bound behind faster ranks' and is dropped. With ``drop``
each rank keeps up to 2 (k + 1) rollouts ahead that could still be fresh at the next step (a memory
bound, ours), whatever the trainer's progress, so stale ones get dropped.

Resume: the queues are not checkpointed. A checkpoint keeps each rollout rank's position (its
rollouts the trainer received and the problems it had drawn by then); a resumed run restores them
and regenerates from the resumed weights, so its first k steps have a smaller lag than an
uninterrupted run's (the trainer logs it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_sspo.metrics import MetricPair, max_pair, mean_pair
from nemo_sspo.rollouts.records import VersionedRollout

__all__ = ["FreeQueue", "LockStepRollouts", "dropped_sums", "is_fresh", "partial_sums", "rollout_idle_s", "version_lag_sums"]


class LockStepRollouts:
    """The rollouts in flight under lock-step staleness (module docstring).

    Args:
        max_staleness: k >= 0 (``rollout.schedule.max_staleness``).
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
                across the replica, as :meth:`nemo_sspo.rollouts.producer.RolloutProducer.produce`).

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
        A ``"mean"`` and a ``"max"`` metric pair over the rollout's responses (each its own version).
    """
    lags = (step - 1 - versioned.versions()).float()
    samples = lags.numel()
    valid = torch.ones(samples, dtype=torch.bool)
    return {"rollout/version_lag_mean": mean_pair(lags.sum(), samples),
            "rollout/version_lag_max": max_pair(lags, valid)}


def partial_sums(versioned: VersionedRollout) -> dict[str, MetricPair]:
    """``rollout/partial_share``: responses sampled by more than one policy version (partial
    rollouts, continued across a refit) over the rollout's responses; {} without token versions.
    """
    rb = versioned.rollout.batch
    if rb.token_versions is None:
        return {}
    newest = torch.where(rb.response_mask, rb.token_versions, -1).amax(dim=1)
    spans = (newest > versioned.versions()).sum()
    return {"rollout/partial_share": mean_pair(spans.float(), rb.response_mask.shape[0])}


def is_fresh(version: int, step: int, max_staleness: int) -> bool:
    """Whether step ``step`` (starting from version ``step - 1``) may train on a rollout of ``version``.

    Args:
        version: updates behind the weights that generated the rollout.
        step: the step about to train (1-based).
        max_staleness: k (``rollout.schedule.max_staleness``).

    Returns:
        ``(step - 1) - version <= max_staleness``.
    """
    return step - 1 - version <= max_staleness


class FreeQueue:
    """A rollout rank's view of the free-running schedule (module docstring).

    Args:
        max_staleness: k >= 0.
        policy: ``wait`` or ``drop`` (``rollout.schedule.stale_policy``).
        last_step: ``trainer.max_steps``.
        version: updates behind the weights the rollout rank holds (0, or a resumed run's step).
        sent: this rank's rollouts the trainer had received (0, or a resumed run's position): the next
            one is number ``sent + 1``.
        num_ranks: R, the rollout ranks (the run needs R fresh rollouts per step).

    Attributes:
        version: updates behind the weights the rollout rank holds.
        sent: the number of the last rollout sent.
    """

    def __init__(self, max_staleness: int, policy: str, last_step: int, version: int, sent: int,
                 num_ranks: int = 1) -> None:  # noqa: D107 - documented on the class
        if policy not in ("wait", "drop"):
            raise ValueError(f"policy={policy!r} must be 'wait' or 'drop'")
        self.max_staleness, self.policy, self.last_step, self.num_ranks = max_staleness, policy, last_step, num_ranks
        self.version, self.sent = version, sent
        self._pending: list[tuple[int, int]] = []  # (rollout number, version) sent but not known taken

    def record(self, version: int) -> int:
        """Counts a rollout about to be sent with ``version``; returns its number."""
        self.sent += 1
        self._pending.append((self.sent, version))
        return self.sent

    def take_notice(self, version: int, taken: int) -> int:
        """Takes a notice: the trainer holds ``version`` and has received ``taken`` of this rank's rollouts.

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
        of idling while the trainer would wait for a fresh one. With ``wait`` a rank also keeps no
        more than the R (last_step - version) rollouts the remaining steps train. The trainer never
        starves: each step takes at least one rollout, so after each notice at least one more may start.
        """
        k = self.max_staleness
        could_train = sum(v >= self.version - k for _, v in self._pending)
        if self.policy == "wait":
            return could_train < min(k + 1, self.num_ranks * (self.last_step - self.version))
        return could_train < 2 * (k + 1)


def dropped_sums(dropped: int, trained: int = 1) -> dict[str, MetricPair]:
    """``rollout/dropped_share``: rollouts dropped / rollouts received, in one step.

    Args:
        dropped: rollouts this step dropped before those it trains on.
        trained: rollouts it trains on (free-running: the R rollout ranks' share of a step).

    Returns:
        A ``"mean"`` pair (the same on every data-parallel rank, which all see the same rollouts).
    """
    return {"rollout/dropped_share": mean_pair(float(dropped), dropped + trained)}


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
