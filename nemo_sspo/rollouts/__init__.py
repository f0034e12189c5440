"""Rollouts: what a step trains on, where it comes from, how it travels, and where the updated weights go.

The package, by module:

- :mod:`~nemo_sspo.rollouts.records`: the dataclasses that travel (``Rollout``, ``VersionedRollout``,
  ``RolloutPosition``, ``Piece``);
- :mod:`~nemo_sspo.rollouts.sampling`: a generating rank's prompt groups, generated and scored
  (slots' seeds, dynamic sampling, overlong shaping);
- :mod:`~nemo_sspo.rollouts.slots`: slot arithmetic, cutting and stacking rollouts;
- :mod:`~nemo_sspo.rollouts.codec`: rollouts as tensors between ranks;
- :mod:`~nemo_sspo.rollouts.worker`: a rollout rank's loop (``rollout.schedule.placement: separate``; the
  design of both separate modes is its docstring);
- :mod:`~nemo_sspo.rollouts.collector`: training rank 0's free-running receive and weight posts;
- :mod:`~nemo_sspo.rollouts.staleness`: lock-step and free-running staleness bookkeeping;
- :mod:`~nemo_sspo.rollouts.source` and the three sources below.

One protocol, one class per mode.

The trainer calls its :class:`RolloutSource` once per step for the rollout it trains on
(:meth:`~RolloutSource.next_rollout`) and once after the update to hand the new weights to the
rollout side (:meth:`~RolloutSource.after_update`); ``train_step`` branches on neither the
placement nor the staleness schedule. The modes:

- :class:`ColocatedSource` (``rollout.schedule.placement: colocated``): the training ranks' own engines,
  lock-step staleness k (:class:`~nemo_sspo.rollouts.staleness.LockStepRollouts`), refit into the
  engine after every update;
- :class:`LockStepSource` (``separate``, ``schedule.mode: lockstep``): rollouts received from
  the rollout ranks in slot order, the weights broadcast to them after every update;
- :class:`FreeRunningSource` (``separate``, ``schedule.mode: free``): the next fresh rollout of
  a free-running rollout rank, the weights posted without waiting for it.

A new mode is one class with these methods.
"""

from nemo_sspo.rollouts.colocated import ColocatedSource
from nemo_sspo.rollouts.free_running import FreeRunningSource
from nemo_sspo.rollouts.source import RefitOutcome, RolloutSource, StepRollout
from nemo_sspo.rollouts.separate import LockStepSource

__all__ = ["ColocatedSource", "FreeRunningSource", "LockStepSource", "RefitOutcome", "RolloutSource", "StepRollout"]
