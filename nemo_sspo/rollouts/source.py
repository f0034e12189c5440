"""The rollout-source protocol and what its calls return (package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from nemo_sspo.metrics import MetricPair
from nemo_sspo.rollouts.records import RolloutPosition
from nemo_sspo.rollouts.records import Piece, VersionedRollout

__all__ = ["RefitOutcome", "RolloutSource", "SourceFigures", "StepRollout"]


@dataclass(frozen=True)
class StepRollout:
    """The rollout a step trains on.

    Attributes:
        versioned: this replica's rollout with its policy version(s), data position and generation window.
        pieces: the free-running rollouts it stacks, in arrival order (empty for the other modes).
        dropped: the free-running rollouts dropped as too stale meanwhile.
    """

    versioned: VersionedRollout
    pieces: list[Piece] = field(default_factory=list)
    dropped: list[Piece] = field(default_factory=list)


@dataclass(frozen=True)
class RefitOutcome:
    """What handing the updated weights to the rollout side cost.

    Attributes:
        seconds_per_gb: the broadcast's rate, export included (lock-step separate); None where it is
            not measured (colocated: the engine loads in place; free-running: the broadcast completes
            whenever the rollout rank joins).
        wait_s: seconds this rank waited for the rollout side (free-running: after the last step, for
            the last post to be taken and the drain); 0 otherwise.
        bytes_to_host: weight bytes the refit copied from a device to host memory
            (``refit/bytes_to_host``): colocated 0 (the export goes straight into the engine on its
            device; what an engine does inside its own load is not counted), lock-step separate the
            broadcast's (``nemo_sspo.parallel.weight_broadcast.BroadcastStats.bytes_to_host``: 0 over
            NCCL; on a CPU run also 0, since no tensor is then on a device); None where not measured
            (free-running).
        bytes: the bytes the refit loaded or sent (``refit/bytes``: every weight, or under
            ``model.lora.refit=adapters`` the adapters alone): colocated on the generating rank (0 on the
            replica's other ranks, which load nothing), lock-step separate the broadcast's on every
            training rank; None where not measured (free-running).
    """

    seconds_per_gb: float | None = None
    wait_s: float = 0.0
    bytes_to_host: int | None = None
    bytes: int | None = None


@dataclass(frozen=True)
class SourceFigures:
    """What a rollout source reports of a step, as data (the trainer's step metrics reduce and draw it).

    Attributes:
        pairs: metric pairs to reduce over the data-parallel ranks (version lag, drops, partial share).
        values: plain metrics, the same on every rank (idle times, run totals).
        windows: the timeline's ``(lane, phase, (start, end))`` of the step's rollout generation (unix seconds).
        wait_phase: the timeline name of the training ranks' wait for the rollout ("wait"), or None when
            the training ranks generate it themselves (``windows`` then shows that).
    """

    pairs: dict[str, MetricPair]
    values: dict[str, float]
    windows: list[tuple[str, str, tuple[float, float]]]
    wait_phase: str | None


class RolloutSource(Protocol):
    """Where the trainer's rollouts come from (package docstring). Every method is collective over
    the training ranks.

    Attributes:
        rollout_gpus: GPUs of the rollout ranks, or None when the training GPUs generate.
    """

    rollout_gpus: int | None

    def start(self, completed_steps: int, problems_drawn: int,
              positions: list[RolloutPosition] | None = None) -> None:
        """Begins a run after ``completed_steps`` (0: fresh; else resumed, the restored weights are the
        rollout side's first) at data position ``problems_drawn`` (free-running: each rollout rank's
        ``positions`` where the checkpoint kept them).
        """

    def rollout_positions(self) -> list[RolloutPosition] | None:
        """What a checkpoint keeps per rollout rank (free-running, on training rank 0), else None."""

    def next_rollout(self, step: int) -> StepRollout:
        """The rollout step ``step`` trains on, shared across the replica's model-parallel ranks."""

    def after_update(self, step: int) -> RefitOutcome:
        """Hands the weights after step ``step``'s update to the rollout side (after the last step:
        ends the rollout side's run).
        """

    def push_weights(self) -> float | None:
        """Loads the trainer's current weights into the rollout side now, waiting until it has them;
        returns the seconds per GB where measured.
        """

    def figures(self, step: int, got: StepRollout, generation_wait_s: float, refit: RefitOutcome) -> SourceFigures:
        """This mode's figures of step ``step`` (``got`` with its generation window over every generating
        rank; ``generation_wait_s``: this rank's wait for it; ``refit``: what :meth:`after_update` returned).
        """
