"""What a rollout is as it travels from the generating rank to the loss: the scored rollout
(:class:`Rollout`), its policy version(s) and data position (:class:`VersionedRollout`), and what a
free-running trainer keeps of each rollout rank (:class:`RolloutPosition`, :class:`Piece`).

Every transport (:mod:`nemo_sspo.rollouts.codec`) carries these dataclasses field by field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from nemo_sspo.rollout import RolloutBatch

__all__ = ["Piece", "Rollout", "RolloutPosition", "VersionedRollout"]


@dataclass
class Rollout:
    """A data-parallel rank's scored rollouts (identical on all TP/PP ranks of its replica).

    Attributes:
        batch: the ``P/dp * G`` responses, grouped by slot in slot order.
        task_rewards: ``[B]`` float32, the reward function's scores.
        rewards: ``[B]`` float32, ``task_rewards`` plus overlong shaping (what advantages use).
        rounds: generation rounds of this step (the same on every rank).
        generated_groups: groups this rank generated this step (>= P/dp with dynamic sampling).
        prompt_keys: ``P/dp`` stable keys of the groups' problems, in slot order (:func:`prompt_key`).
        slot_generated: groups generated for each of the ``P/dp`` slots, in slot order (they sum to
            ``generated_groups``), as the sampler returns it; None where only the total is known (a
            rollout received from a rollout rank).
        reward_timeouts: responses of this step (every sampling round) whose scoring hit the
            reward's deadline and scored 0 (from a reward with a ``timeouts`` counter, as
            ``MathVerifyReward``); None when the reward keeps no count or the rollout was received.
        scored_responses: responses this rank scored this step, every sampling round.
    """

    batch: RolloutBatch
    task_rewards: torch.Tensor
    rewards: torch.Tensor
    rounds: int
    generated_groups: int
    prompt_keys: list[str]
    slot_generated: list[int] | None = None
    reward_timeouts: int | None = None
    scored_responses: int = 0


@dataclass(frozen=True)
class VersionedRollout:
    """A step's rollout with the policy version that generated it.

    Attributes:
        rollout: the scored rollout.
        version: updates behind the weights that generated it (0 = the initial weights).
        problems_drawn: the sampler's data position right after generating it (what a checkpoint
            taken once this rollout is trained must restore); 0 off generator ranks.
        generated: unix seconds (start, end) of its generation and scoring, on the rank that ran them.
        sample_versions: ``[B]`` int64, each response's version, where they differ (a free-running
            step's rollouts from several rollout ranks); None: every response has ``version``.
    """

    rollout: Rollout
    version: int
    problems_drawn: int
    generated: tuple[float, float] = (0.0, 0.0)
    sample_versions: torch.Tensor | None = None

    def versions(self) -> torch.Tensor:
        """``[B]`` int64: each response's policy version (a partial rollout's: its oldest token's)."""
        if self.sample_versions is not None:
            return self.sample_versions
        per_token = self.rollout.batch.token_versions
        if per_token is not None:
            return torch.where(self.rollout.batch.response_mask, per_token, torch.iinfo(torch.int64).max).amin(dim=1)
        return torch.full((self.rollout.rewards.numel(),), self.version, dtype=torch.int64)


class Piece(NamedTuple):
    """A free-running rollout as the trainer received it (for metrics, the timeline and resume).

    Attributes:
        source: index j in 0..R-1 of the rollout rank that generated it.
        number: its number among that rank's rollouts (1-based).
        version: its (oldest response's) policy version.
        generated: unix seconds (start, end) of its generation, on the rollout rank.
    """

    source: int
    number: int
    version: int
    generated: tuple[float, float]


class RolloutPosition(NamedTuple):
    """Where a rollout rank's stream stands: what a free-running checkpoint keeps per rollout rank.

    Attributes:
        received: its rollouts the trainer has received (trained or dropped); the next is number
            ``received + 1`` (lock-step: the steps done).
        problems_drawn: problems it had drawn from its prompt stream by then.
    """

    received: int
    problems_drawn: int
