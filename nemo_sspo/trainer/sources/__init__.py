"""Where a step's rollout comes from and where the updated weights go: one protocol, one class per mode.

The trainer calls its :class:`RolloutSource` once per step for the rollout it trains on
(:meth:`~RolloutSource.next_rollout`) and once after the update to hand the new weights to the
rollout side (:meth:`~RolloutSource.after_update`); ``train_step`` branches on neither the
placement nor the staleness schedule. The modes:

- :class:`ColocatedSource` (``rollout.placement: colocated``): the training ranks' own engines,
  lock-step staleness k (:class:`~nemo_sspo.trainer.staleness.LockStepRollouts`), refit into the
  engine after every update;
- :class:`LockStepSource` (``separate``, ``staleness_schedule: lockstep``): rollouts received from
  the rollout ranks in slot order, the weights broadcast to them after every update;
- :class:`FreeRunningSource` (``separate``, ``staleness_schedule: free``): the next fresh rollout of
  a free-running rollout rank, the weights posted without waiting for it.

A new mode is one class with these methods (:func:`build_rollout_source` picks it from the config).
"""

from nemo_sspo.trainer.sources.colocated import ColocatedSource
from nemo_sspo.trainer.sources.free_running import FreeRunningSource
from nemo_sspo.trainer.sources.protocol import RefitOutcome, RolloutSource, StepRollout
from nemo_sspo.trainer.sources.separate import LockStepSource

__all__ = ["ColocatedSource", "FreeRunningSource", "LockStepSource", "RefitOutcome", "RolloutSource", "StepRollout"]
