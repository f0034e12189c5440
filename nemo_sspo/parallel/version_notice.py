"""Version notices of free-running staleness: the trainer says, without waiting, that new weights follow.

``rollout.schedule.mode: free`` (``nemo_sspo.rollouts.worker``). Over a rollout rank's pair
group (``WorldSplit.pairs``, :mod:`nemo_sspo.parallel.world_split`), group rank 0 (the trainer's
export rank) broadcasts a notice ``int64 [1 + R]`` = (policy version, then for each of the R
rollout ranks the rollouts the trainer has taken from it so far) after an update; the weight
broadcast of that version
(:mod:`nemo_sspo.parallel.weight_broadcast`) follows it. The last notice carries version
:data:`STOP` and no weights.

They are collectives, not point-to-point messages, because of how gloo runs them: an asynchronous
collective runs on the group's worker threads, reports ``Work.is_completed()`` when it is done and
fails after the group's timeout, while a point-to-point receive only progresses inside ``wait()``.
So a rollout rank can post the receive of the next notice and look at it between two rollouts
without blocking (:class:`NoticeListener`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from nemo_sspo.parallel.weight_broadcast import post_broadcast

__all__ = ["STOP", "Notice", "NoticeListener", "post_notice"]

STOP = -1
"""The notice version that ends free-running generation (no weights follow)."""


class Notice(NamedTuple):
    """One notice.

    Attributes:
        version: updates behind the weights that follow, or :data:`STOP`.
        taken: for each rollout rank, its rollouts the trainer has received so far (trained or
            dropped), counted from the run's start (a resumed run counts from its checkpoint).
    """

    version: int
    taken: tuple[int, ...]


def post_notice(notice: Notice, *, group: dist.ProcessGroup) -> tuple[torch.Tensor, object]:
    """Starts broadcasting ``notice`` from group rank 0 (this rank) of a pair group.

    Args:
        notice: the version about to be broadcast (or :data:`STOP`) and the rollouts taken.
        group: a rollout rank's pair group, this rank its rank 0.

    Returns:
        ``(tensor, work)``: keep the tensor alive until ``work.wait()`` has returned (it raises gloo's
        RuntimeError when a rollout rank died or did not take the notice within the group's timeout).
    """
    tensor = torch.tensor([notice.version, *notice.taken], dtype=torch.int64)
    return tensor, post_broadcast(group, tensor)


class NoticeListener:
    """A rollout rank's receive of the next notice, posted ahead (module docstring).

    Args:
        group: this rollout rank's pair group (this rank is not its rank 0).
        num_rollout_ranks: R, the rollout ranks (a notice holds 1 + R numbers).
    """

    def __init__(self, group: dist.ProcessGroup, num_rollout_ranks: int) -> None:  # noqa: D107
        self._group, self._size = group, 1 + num_rollout_ranks
        self._tensor, self._work = torch.zeros(self._size, dtype=torch.int64), None
        self._post()  # posted ahead: the first notice comes after step 1's update

    def _post(self) -> None:
        self._tensor = torch.zeros(self._size, dtype=torch.int64)
        self._work = post_broadcast(self._group, self._tensor)

    def ready(self) -> bool:
        """Whether the next notice has come (posting its receive first if needed); call it only
        between notices, once the weights of the last one are taken.
        """
        if self._work is None:
            self._post()
        return self._work.is_completed()

    def poll(self, *, block: bool) -> Notice | None:
        """The next notice if it has come (or, with ``block``, once it comes); None otherwise.

        After a notice other than :data:`STOP` the caller must take the weight broadcast that follows
        before it polls again: collectives of the group match in order, so the next notice's receive
        is posted by that next call.

        Args:
            block: wait for the notice (up to the group's timeout) instead of returning None.

        Returns:
            The :class:`Notice`, or None when it has not come and ``block`` is False.

        Raises:
            RuntimeError: naming training rank 0, when it died or sent no notice within the group's
                timeout (gloo's error chained).
        """
        if self._work is None:
            self._post()
        if not block and not self._work.is_completed():
            return None
        try:
            self._work.wait()
        except RuntimeError as err:
            raise RuntimeError(f"training rank 0 sent no new policy version (it died or hung past the timeout): "
                               f"{err}") from err
        self._work = None
        version, *taken = self._tensor.tolist()
        return Notice(version, tuple(taken))
