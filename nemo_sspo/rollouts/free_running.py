"""``rollout.schedule.placement: separate`` with ``rollout.schedule.mode: free``: R >= 1 rollout ranks run free.

Each numbers its rollouts (P / R prompt groups each) and generates each with the newest weights it
has taken. Training rank 0 takes a step's R rollouts in the order they arrive, from whichever ranks
sent them, and drops those older than ``rollout.schedule.max_staleness`` versions
(:class:`~nemo_sspo.rollouts.collector.RolloutCollector`); every training rank then gets the step's
rows of its replica, each response with its own version. After every update training rank 0 posts
the version and its weights without waiting to every rollout rank that has taken the one posted to
it before (:class:`~nemo_sspo.rollouts.collector.FreeRefit`);
after the last step it posts the stop and drains the rollouts not taken. A checkpoint keeps each
rollout rank's :class:`~nemo_sspo.rollouts.records.RolloutPosition`.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from nemo_sspo.megatron import WeightExporter
from nemo_sspo.parallel.world_split import WorldSplit
from nemo_sspo.rollouts.codec import broadcast_rollout
from nemo_sspo.rollouts.collector import FreeRefit, RolloutCollector
from nemo_sspo.rollouts.records import RolloutPosition
from nemo_sspo.rollouts.slots import slot_rows, stack_rollouts
from nemo_sspo.rollouts.source import RefitOutcome, SourceFigures, StepRollout
from nemo_sspo.rollouts.separate import SeparateSource
from nemo_sspo.rollouts.records import Piece, VersionedRollout
from nemo_sspo.rollouts.staleness import dropped_sums, is_fresh, partial_sums, rollout_idle_s, version_lag_sums

__all__ = ["FreeRunningSource"]


class FreeRunningSource(SeparateSource):
    """The free-running mode (module docstring; :class:`~nemo_sspo.rollouts.RolloutSource`).

    Args:
        last_step: ``trainer.max_steps`` (its refit is the stop).
        peer_timeout_s: ``rollout.schedule.peer_timeout_s`` (a rollout rank silent that long is named).
        pad_id: the tokenizer's pad id (a step's rollouts are re-padded to one width).
        Others: as :class:`~nemo_sspo.rollouts.separate.SeparateSource`.
    """

    def __init__(self, groups, split: WorldSplit, exporter: WeightExporter, *, max_staleness: int,
                 last_step: int, peer_timeout_s: float, pad_id: int) -> None:  # noqa: D107 - documented on the class
        super().__init__(groups, split, exporter, max_staleness=max_staleness)
        self.last_step, self.peer_timeout_s, self.pad_id = last_step, peer_timeout_s, pad_id
        self.free_refit = FreeRefit(split) if dist.get_rank() == 0 else None
        self.collector: RolloutCollector | None = None  # training rank 0's, from start()
        self.dropped_total = 0
        self.skipped_total = 0  # versions not posted to a rollout rank still taking the one before
        self._ends: dict[int, float] = {}  # rollout rank -> end of its last generation received (idle time)

    def start(self, completed_steps: int, problems_drawn: int,
              positions: list[RolloutPosition] | None = None) -> None:
        """As :meth:`SeparateSource.start`; rollout rank j resumes from ``positions[j]`` (None: a fresh
        run, or a checkpoint of one rollout rank written before positions were kept, whose position is
        ``(completed_steps, problems_drawn)``).

        Raises:
            ValueError: ``positions`` does not hold one position per rollout rank, or is None for a
                resumed run of several.
        """
        count = self.split.num_rollout_ranks
        if positions is None:
            if completed_steps and count > 1:
                raise ValueError("the checkpoint keeps no rollout rank positions, which a free-running resume of "
                                 f"rollout.schedule.num_ranks={count} needs; resume it with its own settings")
            positions = [RolloutPosition(completed_steps, problems_drawn)] * count
        if len(positions) != count:
            raise ValueError(f"the checkpoint keeps the positions of {len(positions)} rollout rank(s), this run has "
                             f"rollout.schedule.num_ranks={count}; resume free-running with "
                             f"rollout.schedule.num_ranks={len(positions)}")
        positions = [RolloutPosition(*position) for position in positions]
        if dist.get_rank() == 0:
            self.collector = RolloutCollector(self.split, positions, self.peer_timeout_s)
        super().start(completed_steps, problems_drawn, positions)

    def rollout_positions(self) -> list[RolloutPosition] | None:
        """Each rollout rank's position after the rollouts received so far (training rank 0; None elsewhere)."""
        return None if self.collector is None else list(self.collector.positions)

    def next_rollout(self, step: int) -> StepRollout:
        """The step's R fresh rollouts in arrival order, this replica's rows of them, and the pieces
        received (trained and dropped).
        """
        collected = self._collect(step) if self.collector is not None else None
        got = broadcast_rollout(collected, cls=StepRollout, src=0)  # over the training ranks
        stacked, pieces, dropped = got.versioned, got.pieces, got.dropped
        g = self.groups
        rows = stacked.rollout.rewards.numel() // g.dp_size
        cut = slice(g.dp_rank * rows, (g.dp_rank + 1) * rows)
        versions = stacked.versions()[cut]
        mine = VersionedRollout(slot_rows(stacked.rollout, cut.start, cut.stop), version=int(versions.min()),
                                problems_drawn=stacked.problems_drawn, generated=stacked.generated,
                                sample_versions=versions)
        self.dropped_total += len(dropped)
        return StepRollout(mine, pieces=pieces, dropped=dropped)

    def _collect(self, step: int) -> StepRollout:
        """Training rank 0: rollouts in arrival order until R are fresh for step ``step``, stacked,
        with the pieces received (trained and dropped).
        """
        accepted, pieces, dropped = [], [], []
        while len(accepted) < self.split.num_rollout_ranks:
            j, versioned = self.collector.next(f"rollout for step {step}")
            piece = Piece(j, self.collector.positions[j].received, versioned.version, versioned.generated)
            if is_fresh(versioned.version, step, self.max_staleness):
                accepted.append(versioned)
                pieces.append(piece)
            else:
                dropped.append(piece)
        drawn = sum(position.problems_drawn for position in self.collector.positions)
        return StepRollout(stack_rollouts(accepted, pad_id=self.pad_id, problems_drawn=drawn), pieces, dropped)

    def after_update(self, step: int) -> RefitOutcome:
        """Training rank 0 posts version ``step`` and its weights without waiting, to every rollout rank
        that has taken the version posted to it before (the others skip this one); after the last
        step it posts the stop instead (waiting for the last posts) and drains the rollouts not taken.
        """
        if step == self.last_step:
            waited = 0.0
            if self.collector is not None:
                waited = self.free_refit.stop(self._taken())
                start = time.perf_counter()
                self.collector.drain()
                waited += time.perf_counter() - start
            return RefitOutcome(None, waited)
        box = [self.free_refit.free_ranks() if self.free_refit is not None else None]
        dist.broadcast_object_list(box, src=0)  # every training rank exports, or skips it, together
        free = box[0]
        self.skipped_total += self.split.num_rollout_ranks - len(free)
        if free:  # the ranks still taking an earlier version get a newer one after a later step
            self.export_to_rollout_ranks(lambda buckets: self.free_refit.post(step, self._taken(), buckets, free))
        return RefitOutcome(None, 0.0)

    def _taken(self) -> list[int]:
        return [position.received for position in self.collector.positions]

    def figures(self, step: int, got: StepRollout, generation_wait_s: float, refit: RefitOutcome) -> SourceFigures:
        """The version lag of every response (a partial one's: its oldest token's), the drops (the
        step's share and the run's total), the share of partial responses, each side's idle time (the
        rollout side's: the mean over rollout ranks) and each rollout received this step on its rank's
        lane (``generation`` or ``dropped``).
        """
        pairs = {**version_lag_sums(got.versioned, step), **dropped_sums(len(got.dropped), len(got.pieces)),
                 **partial_sums(got.versioned)}
        values = {**self.idle_seconds(got, generation_wait_s, refit), "rollout/dropped_total": float(self.dropped_total),
                  "rollout/refits_skipped_total": float(self.skipped_total)}
        windows = [(f"{self.lane} {p.source}", phase, p.generated)
                   for phase, pieces in (("dropped", got.dropped), ("generation", got.pieces)) for p in pieces]
        return SourceFigures(pairs, values, windows, wait_phase="wait")

    def rollout_idle(self, got: StepRollout) -> float:
        """Mean over rollout ranks of each one's gaps before its rollouts received this step (a rank
        that sent none this step counts 0).
        """
        received = sorted(got.pieces + got.dropped, key=lambda p: p.number)
        idle = []
        for j in range(self.split.num_rollout_ranks):
            windows = [p.generated for p in received if p.source == j]
            idle.append(rollout_idle_s(windows, self._ends.get(j)))
            if windows:
                self._ends[j] = windows[-1][1]
        return sum(idle) / len(idle)
