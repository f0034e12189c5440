"""The one generation path: a step's prompt groups generated, scored and shared within the replica.

A :class:`RolloutProducer` serves colocated training ranks and rollout ranks alike. On the
replica's generating rank its :class:`~nemo_sspo.rollouts.sampling.RolloutSampler` generates and
scores the rank's slots (dynamic sampling included); the rollout then goes to the replica's other
model-parallel ranks and, under context parallelism, to the CP ranks (the *fan-out*: one tensor
broadcast per group, :func:`~nemo_sspo.rollouts.codec.broadcast_rollout`). A rollout rank is a
replica of one rank: it has no fan-out, and :mod:`nemo_sspo.rollouts.worker` sends the result on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist

from nemo_sspo.rollouts.codec import broadcast_rollout
from nemo_sspo.rollouts.records import Rollout, VersionedRollout
from nemo_sspo.rollouts.sampling import RolloutSampler

__all__ = ["FanOut", "RolloutProducer"]


@dataclass(frozen=True)
class FanOut:
    """One hop of the in-replica fan-out: the rollout goes from global rank ``src`` to every rank of ``group``.

    Attributes:
        src: the sending global rank (the replica's generating rank for the model-parallel hop, CP
            rank 0 for the context-parallel hop).
        group: the process group of the hop (this rank is in it).
    """

    src: int
    group: dist.ProcessGroup


class RolloutProducer:
    """Generates, scores and fans out one step's rollout (module docstring).

    Args:
        sampler: this rank's sampler, or None on ranks that do not generate (they receive).
        fan_out: the hops, in order (empty: nothing to share, e.g. a rollout rank or a replica of one rank).
    """

    def __init__(self, sampler: RolloutSampler | None, fan_out: list[FanOut]) -> None:  # noqa: D107
        self.sampler, self.fan_out = sampler, fan_out

    @property
    def problems_drawn(self) -> int:
        """The sampler's data position after its last rollout (0 on ranks without a sampler)."""
        return self.sampler.problems_drawn if self.sampler is not None else 0

    def produce(self, step: int, version: int) -> VersionedRollout:
        """Step ``step``'s rollout from the engine's current weights (collective over the fan-out groups).

        Args:
            step: the step whose prompts and seeds to generate (1-based).
            version: updates behind the weights the engine holds (recorded with the rollout).

        Returns:
            The rollout on every rank of the replica, with its version, the sampler's data position and
            its generation window (unix seconds on this rank, fan-out included).
        """
        start = time.time()
        rollout = self.sampler.collect(step) if self.sampler is not None else None
        for hop in self.fan_out:
            rollout = broadcast_rollout(rollout, cls=Rollout, src=hop.src, group=hop.group)
        return VersionedRollout(rollout, version=version, problems_drawn=self.problems_drawn,
                                generated=(start, time.time()))

