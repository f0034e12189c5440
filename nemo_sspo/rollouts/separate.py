"""``rollout.schedule.placement: separate``: rollouts from the rollout ranks, weights broadcast to them.

What both separate modes share (:class:`SeparateSource`): the start announcement (where the run
starts and each replica's receiving rank), the weight broadcast from the first replica's export rank
(training rank 0) to every rollout rank, the replica-wide share of a received rollout, and each
side's idle time. :class:`LockStepSource` is the lock-step mode: step t's prompt groups come from the
rollout ranks that generate this replica's slots (:func:`~nemo_sspo.rollouts.slots.slot_routes`),
stacked in slot order, and after every update the rollout ranks wait for the broadcast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from nemo_sspo.megatron import WeightExporter
from nemo_sspo.parallel.metric_reduce import collective_device
from nemo_sspo.parallel.world_split import WorldSplit
from nemo_sspo.parallel.weight_broadcast import send_weight_buckets
from nemo_sspo.rollouts.codec import broadcast_rollout, recv_rollout, send_start
from nemo_sspo.rollouts.records import RolloutPosition, VersionedRollout
from nemo_sspo.rollouts.slots import merge_rollouts, slot_routes
from nemo_sspo.rollouts.source import RefitOutcome, SourceFigures, StepRollout
from nemo_sspo.rollouts.staleness import rollout_idle_s, version_lag_sums

__all__ = ["LockStepSource", "SeparateSource"]


class SeparateSource:
    """The parts both separate modes share (module docstring).

    Args:
        groups: this training rank's parallel groups (``nemo_sspo.megatron.ParallelGroups``).
        split: its place in the split world.
        exporter: the policy's weights, gathered on the replica's export rank (collective over the
            replica's model-parallel ranks).
        max_staleness: k >= 0 (``rollout.schedule.max_staleness``).
    """

    lane = "rollout rank"
    """The timeline lane of the rollout ranks' generation (free-running: one per rollout rank)."""

    def __init__(self, groups, split: WorldSplit, exporter: WeightExporter, *,
                 max_staleness: int) -> None:  # noqa: D107 - documented on the class
        self.groups, self.split, self.exporter, self.max_staleness = groups, split, exporter, max_staleness
        self.rollout_gpus = split.num_rollout_ranks
        self._generation_end: float | None = None  # of the last rollout received (rollout idle time)

    @property
    def rollout_ranks(self) -> list[int]:
        """World ranks of the rollout ranks."""
        return list(range(self.split.num_training_ranks, self.split.world_size))

    def start(self, completed_steps: int, problems_drawn: int,
              positions: list[RolloutPosition] | None = None) -> None:
        """Tells every rollout rank where the run starts (the steps done, its position: ``positions[j]``
        or else ``(completed_steps, problems_drawn)``, and each replica's receiving rank); a resumed
        run's weights follow with a broadcast.
        """
        g = self.groups
        mine = torch.tensor([g.dp_rank if g.mp_rank == 0 else -1, dist.get_rank()], device=collective_device(None))
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        replicas = [rank for dp, rank in sorted(t.tolist() for t in gathered) if dp >= 0]  # in data-parallel order
        if dist.get_rank() == 0:
            for j, dst in enumerate(self.rollout_ranks):
                position = positions[j] if positions else RolloutPosition(completed_steps, problems_drawn)
                send_start(completed_steps, position, replicas, dst=dst, group=self.split.bridge)
        if completed_steps > 0:
            self.push_weights()

    def rollout_positions(self) -> None:
        """None: a lock-step checkpoint's data position is the trainer's."""
        return None

    def export_to_rollout_ranks(self, send: Callable[[Iterator], Any]) -> Any:
        """The first replica exports the weights (collective over its model-parallel group): its
        export rank (training rank 0) returns ``send(buckets)``; every other rank returns None.
        """
        if self.groups.dp_rank != 0:
            return None
        buckets = self.exporter.buckets()
        if dist.get_rank() == self.groups.mp_src_rank:
            return send(buckets)
        for _ in buckets:  # this rank's share of the gathers
            pass
        return None

    def push_weights(self) -> float:
        """Broadcasts the current weights to every rollout rank; returns the broadcast's seconds per
        GB, export included (the same on every training rank).
        """
        return self.broadcast_weights(None)[0]

    def broadcast_weights(self, version: int | None) -> tuple[float, int, int]:
        """Broadcasts the current weights to every rollout rank, ``version`` (the step whose update
        they hold, or None) in the stream for the rollout ranks' refit check.

        Returns:
            ``(seconds per GB, export included; weight bytes copied to the host; weight bytes sent)``,
            the same on every training rank.
        """
        stats_row = torch.zeros(3, dtype=torch.float64)
        stats = self.export_to_rollout_ranks(lambda buckets: send_weight_buckets(
            buckets, group=self.split.refit, receivers=self.rollout_ranks, version=version))
        if stats is not None:
            stats_row[0], stats_row[1], stats_row[2] = stats.seconds_per_gb, stats.bytes_to_host, stats.bytes
        on_device = stats_row.to(collective_device(None))
        dist.broadcast(on_device, src=0)
        seconds_per_gb, to_host, sent = on_device.tolist()
        return seconds_per_gb, int(to_host), int(sent)

    def share(self, versioned: VersionedRollout | None) -> VersionedRollout:
        """The rollout the replica's first model-parallel rank received, on every rank of the replica
        (:func:`~nemo_sspo.rollouts.codec.broadcast_rollout` over its model-parallel group).

        Args:
            versioned: the rollout on the replica's first model-parallel rank; None elsewhere.

        Returns:
            The rollout (tensors on the CPU on the other ranks).
        """
        return broadcast_rollout(versioned, cls=VersionedRollout, src=self.groups.mp_src_rank,
                                 group=self.groups.mp_group)

    def idle_seconds(self, got: StepRollout, generation_wait_s: float, refit: RefitOutcome) -> dict[str, float]:
        """``timing/train_idle_s``: this rank's wait for the step's rollout(s) plus the refit's wait for
        the rollout side. ``timing/rollout_idle_s``: the rollout side's time between the rollouts this
        step received (waiting for the trainer, taking weights; :meth:`rollout_idle`).
        """
        return {"timing/train_idle_s": generation_wait_s + refit.wait_s, "timing/rollout_idle_s": self.rollout_idle(got)}

    def rollout_idle(self, got: StepRollout) -> float:
        """The rollout ranks' gap before this step's rollout (:func:`~nemo_sspo.rollouts.staleness.rollout_idle_s`)."""
        idle = rollout_idle_s([got.versioned.generated], self._generation_end)
        self._generation_end = got.versioned.generated[1]
        return idle


class LockStepSource(SeparateSource):
    """The lock-step separate mode (module docstring;
    :class:`~nemo_sspo.rollouts.RolloutSource`).

    Args:
        prompts_per_step: ``rollout.prompts_per_step`` (the slots the rollout ranks split).
        pad_id: the tokenizer's pad id (the parts are padded to one width when stacked).
        Others: as :class:`SeparateSource`.
    """

    def __init__(self, groups, split: WorldSplit, exporter: WeightExporter, *, max_staleness: int,
                 prompts_per_step: int, pad_id: int) -> None:  # noqa: D107 - documented on the class
        super().__init__(groups, split, exporter, max_staleness=max_staleness)
        self.prompts_per_step, self.pad_id = prompts_per_step, pad_id

    def next_rollout(self, step: int) -> StepRollout:
        """This replica's parts of step ``step``'s rollout, from the rollout ranks generating its slots."""
        g, merged = self.groups, None
        if g.mp_rank == 0:
            routes = slot_routes(self.prompts_per_step, g.dp_size, self.split.num_rollout_ranks)
            parts = [recv_rollout(src=self.split.num_training_ranks + route.source, group=self.split.bridge, tag=step)
                     for route in routes if route.replica == g.dp_rank]
            merged = merge_rollouts(parts, pad_id=self.pad_id)
        return StepRollout(self.share(merged))

    def after_update(self, step: int) -> RefitOutcome:
        """The rollout ranks wait for the weights after step ``step``."""
        seconds_per_gb, to_host, sent = self.broadcast_weights(step)
        return RefitOutcome(seconds_per_gb, bytes_to_host=to_host, bytes=sent)

    def figures(self, step: int, got: StepRollout, generation_wait_s: float, refit: RefitOutcome) -> SourceFigures:
        """The version lag (k > 0), each side's idle time and the generation window on the rollout ranks' lane."""
        pairs = version_lag_sums(got.versioned, step) if self.max_staleness > 0 else {}
        return SourceFigures(pairs, self.idle_seconds(got, generation_wait_s, refit),
                             [(self.lane, "generation", got.versioned.generated)], wait_phase="wait")
