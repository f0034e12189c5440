"""Training rank 0's side of the free-running schedule: receiving rollouts from any rollout rank
(:class:`RolloutCollector`) and posting versions and weights without waiting (:class:`FreeRefit`).
The design is in :mod:`nemo_sspo.rollouts.worker`'s docstring.
"""

from __future__ import annotations

import time

import torch

from nemo_sspo.parallel.version_notice import STOP, Notice, post_notice
from nemo_sspo.parallel.weight_broadcast import (
    PendingBroadcast,
    encode_weight_buckets,
    post_weight_broadcast,
)
from nemo_sspo.parallel.world_split import WorldSplit
from nemo_sspo.rollouts.codec import _END_TAG, _recv, recv_free_rollout
from nemo_sspo.rollouts.records import RolloutPosition, VersionedRollout

__all__ = ["FreeRefit", "RolloutCollector"]


class RolloutCollector:
    """Training rank 0's receive of free-running rollouts from every rollout rank (module docstring).

    Args:
        split: the split world (this rank is training rank 0).
        positions: each rollout rank's :class:`RolloutPosition` at the start (all zeros, or a
            resumed run's).
        peer_timeout_s: a rollout rank that sends nothing for longer while others do is named as
            dead or hung (``rollout.schedule.peer_timeout_s``).

    Attributes:
        positions: each rollout rank's position: its rollouts received (trained or dropped) and its
            data position after the last of them.
    """

    def __init__(self, split: WorldSplit, positions: list[RolloutPosition], peer_timeout_s: float) -> None:  # noqa: D107
        self.bridge, self.first, self.peer_timeout_s = split.bridge, split.num_training_ranks, peer_timeout_s
        self.sources = list(range(split.num_training_ranks, split.world_size))
        self.positions = list(positions)
        self._heard = [time.monotonic()] * len(self.sources)

    def next(self, what: str) -> tuple[int, VersionedRollout]:
        """The next rollout to arrive, from any rollout rank.

        Args:
            what: the awaited rollout, for the errors.

        Returns:
            ``(j, rollout)``: the index of the rollout rank that sent it and the rollout.

        Raises:
            RuntimeError: naming the rollout rank silent longest (it died or hung), when none sent a
                rollout within the group's timeout, or when one has sent nothing for longer than
                ``peer_timeout_s`` while the others sent; or a rollout out of its rank's order.
        """
        try:
            src, number, versioned = recv_free_rollout(group=self.bridge, sources=self.sources, what=what)
        except RuntimeError as err:
            raise self._silence(f"no rollout rank sent {what}") from err
        j = src - self.first
        if number != self.positions[j].received + 1:
            raise RuntimeError(f"rollout rank {src} sent rollout {number}, expected {self.positions[j].received + 1}")
        self.positions[j] = RolloutPosition(number, versioned.problems_drawn)
        self._heard[j] = time.monotonic()
        if max(self._silent_s()) > self.peer_timeout_s:
            raise self._silence("the others sent")
        return j, versioned

    def _silent_s(self) -> list[float]:
        now = time.monotonic()
        return [now - heard for heard in self._heard]

    def _silence(self, context: str) -> RuntimeError:
        silent = self._silent_s()
        j = max(range(len(silent)), key=silent.__getitem__)
        return RuntimeError(f"rollout rank {self.sources[j]} sent no rollout for {silent[j]:.1f} s (it died or hung "
                            f"past rollout.schedule.peer_timeout_s={self.peer_timeout_s:g}); {context}")

    def drain(self) -> int:
        """After the stop notice: receives and discards every rollout not taken, rank by rank.

        Returns:
            The number discarded.

        Raises:
            RuntimeError: naming the rollout rank, when it died or hung past the group's timeout.
        """
        discarded = 0
        for j, src in enumerate(self.sources):
            try:
                sent = int(_recv(torch.zeros(1, dtype=torch.int64), src, self.bridge, _END_TAG))
            except RuntimeError as err:
                raise RuntimeError(f"rollout rank {src} did not end its rollouts (it died or hung past the "
                                   f"timeout): {err}") from err
            for number in range(self.positions[j].received + 1, sent + 1):
                recv_free_rollout(group=self.bridge, sources=self.sources, src=src,
                                  what=f"rollout {number} (sent before the stop)")
                discarded += 1
        return discarded


class FreeRefit:
    """Training rank 0's side of the free-running refit (module docstring: what blocks what).

    Each rollout rank j takes its notices and weights over its own pair group (``split.pairs[j]``),
    whenever it is between two rollouts; one rank's post never waits for another rank.

    Args:
        split: the split world (this rank training rank 0).
    """

    def __init__(self, split: WorldSplit) -> None:  # noqa: D107
        self.pairs = split.pairs
        self.ranks = {j: split.num_training_ranks + j for j in split.pairs}  # world ranks, named in errors
        self._in_flight: dict[int, tuple[torch.Tensor, object, PendingBroadcast | None]] = {}

    def free_ranks(self) -> list[int]:
        """The rollout ranks that have taken the last version posted to them (never blocks).

        Raises:
            RuntimeError: as :meth:`wait`, when a post to one of them failed.
        """
        free = []
        for j in self.pairs:
            posted = self._in_flight.get(j)
            if posted is not None:
                _, work, weights = posted
                if not work.is_completed() or (weights is not None and not weights.is_completed()):
                    continue
                self._wait(j)  # done (or failed: raises)
            free.append(j)
        return free

    def post(self, version: int, taken: list[int], buckets, to: list[int]) -> None:
        """Posts the notice of ``version`` and its weights to rollout ranks ``to`` (free ones) without
        waiting for them; the export is encoded once, on the host, for all of them.

        Args:
            version: the policy version (the step just updated).
            taken: for each rollout rank, its rollouts the trainer has received.
            buckets: the export's HF weight buckets (drawn now; the drawing may be collective).
            to: indices of the rollout ranks to post to (from :meth:`free_ranks`).
        """
        encoded = encode_weight_buckets(buckets, torch.device("cpu"))
        for j in to:
            tensor, work = post_notice(Notice(version, tuple(taken)), group=self.pairs[j])
            self._in_flight[j] = (tensor, work, post_weight_broadcast(encoded, group=self.pairs[j],
                                                                      receivers=[self.ranks[j]]))

    def stop(self, taken: list[int]) -> float:
        """Waits for every rollout rank to take its last post, then tells each to stop.

        Returns:
            Seconds waited (the last posts and the stop notices).

        Raises:
            RuntimeError: as :meth:`wait`.
        """
        start = time.perf_counter()
        for j in self.pairs:
            self._wait(j)
            tensor, work = post_notice(Notice(STOP, tuple(taken)), group=self.pairs[j])
            self._in_flight[j] = (tensor, work, None)
        for j in self.pairs:
            self._wait(j)
        return time.perf_counter() - start

    def _wait(self, j: int) -> None:
        """Waits until rollout rank ``j`` took its last notice and weights.

        Raises:
            RuntimeError: naming it, when it did not within the group's timeout (it died or hung).
        """
        posted = self._in_flight.pop(j, None)
        if posted is None:
            return
        _, work, weights = posted
        try:
            work.wait()
        except RuntimeError as err:
            raise RuntimeError(f"rollout rank {self.ranks[j]} took no new policy version (it died or hung past "
                               f"the timeout): {err}") from err
        if weights is not None:
            weights.wait()
