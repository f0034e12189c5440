"""A step's advantages: the estimator ``advantage.name``, its per-prompt history, and the SPPO critic's values.

:class:`AdvantageStep` computes each response's advantage from the step's rollout before the rows
are split into mini- and micro-batches (:meth:`AdvantageStep.compute`), summing the estimator's
scope statistics over the data-parallel ranks
(:func:`nemo_sspo.parallel.advantage_scope.data_parallel_advantages`). It keeps the per-prompt
reward history of a history-keeping estimator (DCPO's ``dcpo_smooth``, or a plug-in's), the
same on every rank and saved in checkpoints (:meth:`AdvantageStep.history_state`).
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_sspo.algorithms import PromptRewardStats, zero_variance_groups
from nemo_sspo.algorithms.advantage_estimators import AdvantageEstimator, AdvantageInputs
from nemo_sspo.algorithms.batch import CriticBatch, pack_critic_batch
from nemo_sspo.megatron import ParallelGroups
from nemo_sspo.metrics import MetricPair, mean_pair
from nemo_sspo.parallel.advantage_scope import data_parallel_advantages
from nemo_sspo.rollouts.records import Rollout
from nemo_sspo.trainer.critic_training import Critic

__all__ = ["AdvantageStep"]


class AdvantageStep:
    """The step's advantages (module docstring).

    Args:
        estimator: the advantage estimator (``advantage.name``).
        groups: this rank's parallel groups.
        samples_per_prompt: responses per prompt (``rollout.samples_per_prompt``).
        minibatches: optimizer steps per step (``trainer.minibatches_per_step``; the scope of a
            mini-batch-scoped estimator).
        normalize_std: divide by the group's reward std (``advantage.normalize_std``, null resolved to
            the loss's default).
        critic: the SPPO critic the ``critic`` estimator reads V(prompt) from, or None.
        pad_id: the tokenizer's pad id (the critic's prompt batch).

    Attributes:
        history: per-prompt reward stats of a history-keeping estimator, keyed by prompt key.
    """

    def __init__(self, estimator: AdvantageEstimator, groups: ParallelGroups, *, samples_per_prompt: int,
                 minibatches: int, normalize_std: bool, critic: Critic | None, pad_id: int) -> None:  # noqa: D107
        self.estimator, self.groups, self.minibatches = estimator, groups, minibatches
        self.samples_per_prompt = samples_per_prompt
        self.normalize_std, self.critic, self.pad_id = normalize_std, critic, pad_id
        self.history: dict[str, PromptRewardStats] = {}

    def compute(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, MetricPair]]:
        """``[B]`` float32 advantages of the rollout's responses and their metric pairs.

        DCPO's smooth standardisation gathers the step's groups of every data-parallel rank in slot
        order, so each rank's per-prompt history takes the same updates in the same order, whatever
        the data-parallel size. The critic estimator reads V(prompt) from the critic before its update
        (collective over the critic's layout; ranks off the last pipeline stage, which never read
        advantages, get 0). Groups with equal task rewards carry no signal whatever their shaped
        rewards (``advantages/zero_variance_group_frac``).
        """
        value_logits = None
        if self.estimator.needs_critic:
            value_logits = self.critic.predict(self.critic_batch(rollout))
            if value_logits is None:
                return torch.zeros_like(rollout.rewards), {}
        inputs = AdvantageInputs(rollout.rewards, rollout.task_rewards, self.samples_per_prompt,
                                 normalize_std=self.normalize_std, value_logits=value_logits,
                                 prompt_keys=rollout.prompt_keys, history=self.history)
        advantages, history = data_parallel_advantages(self.estimator, inputs, minibatches=self.minibatches,
                                                       dp_group=self.groups.dp_group, dp_size=self.groups.dp_size)
        if history is not None:
            self.history = history
        if self.estimator.needs_critic:
            return advantages, {}
        zero = zero_variance_groups(rollout.task_rewards, self.samples_per_prompt)
        return advantages, {"advantages/zero_variance_group_frac": mean_pair(float(zero.sum()), zero.numel())}

    def critic_batch(self, rollout: Rollout) -> CriticBatch:
        """The critic's prompts (one per group) and BCE targets (the 0/1 task rewards)."""
        rb = rollout.batch
        return pack_critic_batch(rb.prompt_ids, rb.prompt_mask, rollout.task_rewards, self.samples_per_prompt,
                                 pad_id=self.pad_id)

    def history_state(self) -> dict[str, list[float]] | None:
        """The history as a checkpoint keeps it (``[visits, mean, std]`` per prompt key), or None for an
        estimator that keeps none.
        """
        if self.estimator.next_history is None:
            return None
        return {key: [st.visits, st.mean, st.std] for key, st in self.history.items()}

    def restore_history(self, saved: dict[str, Any] | None) -> bool:
        """Restores :meth:`history_state`'s output (None: every prompt restarts at its first visit).

        Returns:
            False when the estimator keeps a history but ``saved`` is None (the caller warns), else True.
        """
        if self.estimator.next_history is None:
            return True
        self.history = {key: PromptRewardStats(int(visits), float(mean), float(std))
                        for key, (visits, mean, std) in (saved or {}).items()}
        return saved is not None
