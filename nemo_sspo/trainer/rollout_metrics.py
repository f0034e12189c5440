"""Per-step statistics of a rollout as ``"mean"`` metric pairs (:mod:`nemo_sspo.metrics`): rewards,
lengths, truncation, dynamic-sampling rounds, and the gap between the rollout engine's and the
trainer's log-probs.
"""

from __future__ import annotations

from nemo_sspo.algorithms import select_nonzero_variance_groups
from nemo_sspo.metrics import MetricPair, mean_pair
from nemo_sspo.rollouts.records import Rollout

__all__ = ["TruncationWatch", "rollout_metric_sums"]


def rollout_metric_sums(rollout: Rollout, batch, *, samples_per_prompt: int,
                        shaped_rewards: bool) -> dict[str, MetricPair]:
    """This data-parallel rank's rollout metrics.

    Args:
        rollout: the step's scored rollout.
        batch: its ``PolicyBatch`` with ``old_logprobs`` and ``rollout_logprobs`` filled (last
            pipeline stage). Its rows need not be the rollout's (balancing may have moved them):
            only the log-prob gap reads it.
        samples_per_prompt: G, responses per prompt group (``rollout.samples_per_prompt``).
        shaped_rewards: whether ``rollout.rewards`` differ from the task rewards (overlong
            shaping, ``reward.overlong_buffer_len > 0``): adds ``reward/shaped_mean``.

    Returns:
        ``reward/mean``, ``reward/accuracy``, ``response/length_mean``, ``response/truncated_frac``,
        ``reward/truncated_mean`` (mean task reward of the responses that hit the length cap; 0
        when none did),
        ``rollout/sampling_rounds``, ``rollout/kept_group_frac``, ``reward/shaped_mean`` (with
        overlong shaping), ``reward/timeout_frac`` (share of the step's scored responses, every
        sampling round, whose scoring hit the reward's deadline and scored 0; with a reward that
        counts them) and ``rollout/trainer_logprob_gap_abs`` (mean |log pi_rollout - log pi_old|
        per response token; with router replay R3, pi_old ran the engine's experts).
    """
    rb, task = rollout.batch, rollout.task_rewards
    n = float(task.numel())
    lengths = rb.response_mask.sum(dim=1).float()
    varied = select_nonzero_variance_groups(task, samples_per_prompt).numel()
    sums = {
        "reward/mean": mean_pair(float(task.sum()), n),
        "reward/accuracy": mean_pair(float((task >= 1.0).sum()), n),
        "response/length_mean": mean_pair(float(lengths.sum()), n),
        "response/truncated_frac": mean_pair(float(rb.truncated.float().sum()), n),
        "reward/truncated_mean": mean_pair(float(task[rb.truncated].sum()), float(rb.truncated.sum())),
        # Each data-parallel rank reports the (common) round count once.
        "rollout/sampling_rounds": mean_pair(float(rollout.rounds), 1.0),
        "rollout/kept_group_frac": mean_pair(float(varied), float(rollout.generated_groups)),
    }
    if shaped_rewards:
        sums["reward/shaped_mean"] = mean_pair(float(rollout.rewards.sum()), n)
    if rollout.reward_timeouts is not None:
        sums["reward/timeout_frac"] = mean_pair(float(rollout.reward_timeouts), float(rollout.scored_responses))
    mask = batch.loss_mask
    if mask.any():
        gap = (batch.rollout_logprobs - batch.old_logprobs)[mask].abs()
        sums["rollout/trainer_logprob_gap_abs"] = mean_pair(float(gap.sum()), float(gap.numel()))
    return sums


class TruncationWatch:
    """Says when most responses of a step hit the length cap, once per run
    (``response/truncated_frac`` has every step). What it says of their scores is measured, not
    assumed: a custom reward may score a response that was cut short. With the math reward they
    usually score 0, and a group cut short throughout then has no reward variance and teaches
    nothing, silently (a GSM8K run at 64 new tokens truncates every response).

    Args:
        max_new_tokens: ``rollout.sampling.max_new_tokens``.
        threshold: the truncated share above which it warns (more than half by default).
    """

    def __init__(self, max_new_tokens: int, threshold: float = 0.5) -> None:
        self.max_new_tokens, self.threshold = max_new_tokens, threshold
        self.warned = False

    def check(self, step: int, metrics: dict[str, float]) -> str | None:
        """The warning for ``step``'s metrics (``response/truncated_frac``, and
        ``reward/truncated_mean`` when present), or None.
        """
        frac = metrics.get("response/truncated_frac")
        if self.warned or frac is None or frac <= self.threshold:
            return None
        self.warned = True
        head = (f"step {step}: {frac:.0%} of the responses reached "
                f"rollout.sampling.max_new_tokens={self.max_new_tokens} without a stop token")
        tail = "raise rollout.sampling.max_new_tokens (warned once; response/truncated_frac tracks it)"
        score = metrics.get("reward/truncated_mean")
        if score is None:
            return f"{head}; a response cut short is scored as it stands: {tail}"
        if score == 0.0:
            return (f"{head}, and every one of them scored 0 (a group cut short throughout has no reward "
                    f"variance and teaches nothing): {tail}")
        return f"{head} (their mean reward {score:.2f}, scored as cut): if answers need more room, {tail}"
