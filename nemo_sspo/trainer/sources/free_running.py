"""``rollout.placement: separate`` with ``rollout.staleness_schedule: free``: the rollout rank runs free.

It numbers its rollouts and generates each with the newest weights it has taken; step t trains on
the next received rollout at most ``rollout.max_staleness`` versions old and drops the older ones
(:func:`~nemo_sspo.trainer.placement.receive_fresh_rollout`). After every update training rank 0
posts the version and its weights without waiting (:class:`~nemo_sspo.trainer.placement.FreeRefit`);
after the last step it posts the stop and every receiving rank drains the rollouts not taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from nemo_sspo.metrics import MetricPair
from nemo_sspo.parallel.placement import WorldSplit
from nemo_sspo.trainer.placement import FreeRefit, drain_rollouts, receive_fresh_rollout
from nemo_sspo.trainer.sources.protocol import RefitOutcome, StepRollout
from nemo_sspo.trainer.sources.separate import SeparateSource
from nemo_sspo.trainer.staleness import dropped_sums, version_lag_sums

__all__ = ["FreeRunningSource"]


class FreeRunningSource(SeparateSource):
    """The free-running mode (module docstring; :class:`~nemo_sspo.trainer.sources.RolloutSource`).

    Args:
        last_step: ``trainer.max_steps`` (its refit is the stop).
        Others: as :class:`~nemo_sspo.trainer.sources.separate.SeparateSource`.
    """

    def __init__(self, groups, split: WorldSplit, export: Callable[[], Iterator[dict]], *, max_staleness: int,
                 last_step: int) -> None:  # noqa: D107 - documented on the class
        super().__init__(groups, split, export, max_staleness=max_staleness)
        self.last_step = last_step
        self.free_refit = FreeRefit(split.refit, [split.num_training_ranks]) if dist.get_rank() == 0 else None
        self.received = 0  # rollouts received (trained and dropped): the rollout rank numbers them 1, 2, ...
        self.dropped_total = 0

    def start(self, completed_steps: int, problems_drawn: int) -> None:
        """As :meth:`SeparateSource.start`; the rollout rank numbers its rollouts from ``completed_steps``."""
        super().start(completed_steps, problems_drawn)
        self.received = completed_steps

    def next_rollout(self, step: int) -> StepRollout:
        """The next rollout fresh enough for step ``step``, and the versions and windows of those dropped."""
        box = [None, []]
        if self.groups.mp_rank == 0:
            versioned, dropped = receive_fresh_rollout(step, self.received, self.max_staleness,
                                                       src=self.split.num_training_ranks, group=self.split.bridge)
            box = [versioned, [(d.version, d.generated) for d in dropped]]
        versioned, dropped = self.share(box)
        self.received += 1 + len(dropped)
        self.dropped_total += len(dropped)
        return StepRollout(versioned, dropped)

    def after_update(self, step: int) -> RefitOutcome:
        """Training rank 0 posts version ``step`` and its weights without waiting for the rollout rank;
        after the last step the stop instead, and every receiving rank drains the rollouts not taken.
        The wait is training rank 0's for the rollout rank to take the previous version, or a
        receiving rank's drain.
        """
        waited = 0.0
        if step == self.last_step:
            if self.free_refit is not None:
                waited += self.free_refit.stop(self.received)
            if self.groups.mp_rank == 0:
                start = time.perf_counter()
                drain_rollouts(self.received, src=self.split.num_training_ranks, group=self.split.bridge)
                waited += time.perf_counter() - start
            return RefitOutcome(None, waited)
        posted = self.export_to_rollout_ranks(lambda buckets: self.free_refit.post(step, self.received, buckets))
        return RefitOutcome(None, 0.0 if posted is None else posted)

    def step_metrics(self, step: int, got: StepRollout, generation_wait_s: float,
                     refit: RefitOutcome) -> tuple[dict[str, MetricPair], dict[str, float]]:
        """The version lag, the drops (the step's share and the run's total) and each side's idle time."""
        pairs = {**version_lag_sums(got.versioned, step), **dropped_sums(len(got.dropped))}
        return pairs, {**self.idle_seconds(got, generation_wait_s, refit),
                       "rollout/dropped_total": float(self.dropped_total)}
