"""The warning when most responses of a step hit rollout.sampling.max_new_tokens: it says what they scored, as
measured (a custom reward may score a response that was cut short), never an assumed 0."""

import torch

from nemo_sspo.rollout import RolloutBatch
from nemo_sspo.trainer.rollout_metrics import TruncationWatch, rollout_metric_sums
from nemo_sspo.rollouts.records import Rollout

PREFIX = "step 3: 56% of the responses reached rollout.sampling.max_new_tokens=64 without a stop token"


def test_warns_once_when_more_than_half_are_truncated():
    watch = TruncationWatch(max_new_tokens=64)
    assert watch.check(1, {"response/truncated_frac": 8 / 16}) is None  # exactly half: not "most"
    assert watch.check(2, {"reward/mean": 0.5}) is None  # no truncation metric on this rank
    warning = watch.check(3, {"response/truncated_frac": 9 / 16, "reward/truncated_mean": 0.0})  # 56.25%
    assert warning.startswith(PREFIX + ", and every one of them scored 0")
    assert warning.endswith("raise rollout.sampling.max_new_tokens (warned once; response/truncated_frac tracks it)")
    assert watch.check(4, {"response/truncated_frac": 1.0, "reward/truncated_mean": 0.0}) is None  # once per run


def test_a_reward_that_scores_cut_responses_is_not_said_to_score_zero():
    warning = TruncationWatch(64).check(3, {"response/truncated_frac": 9 / 16, "reward/truncated_mean": 0.375})
    assert warning.startswith(PREFIX + " (their mean reward 0.38, scored as cut)")
    assert "scored 0" not in warning
    unknown = TruncationWatch(64).check(3, {"response/truncated_frac": 9 / 16})
    assert unknown.startswith(PREFIX + "; a response cut short is scored as it stands")
    assert "scored 0" not in unknown


def test_truncated_mean_averages_the_rewards_of_the_cut_responses_only():
    # 4 responses, rewards [1, 0.5, 0, 1]; responses 1 and 2 hit the cap: (0.5 + 0) / 2 = 0.25.
    truncated = torch.tensor([False, True, True, False])
    batch = RolloutBatch(
        prompt_ids=torch.zeros(4, 1, dtype=torch.long), prompt_mask=torch.ones(4, 1, dtype=torch.bool),
        response_ids=torch.zeros(4, 2, dtype=torch.long), response_mask=torch.ones(4, 2, dtype=torch.bool),
        truncated=truncated, response_texts=["a"] * 4, rollout_logprobs=torch.zeros(4, 2))
    rewards = torch.tensor([1.0, 0.5, 0.0, 1.0])
    rollout = Rollout(batch=batch, task_rewards=rewards, rewards=rewards, rounds=1, generated_groups=2,
                      prompt_keys=["p0", "p1"])
    sums = rollout_metric_sums(rollout, _NoRows(), samples_per_prompt=2, shaped_rewards=False)
    total, count = (float(x) for x in sums["reward/truncated_mean"].as_tensor(torch.float64))
    assert (total, count) == (0.5, 2.0)
    total, count = (float(x) for x in sums["response/truncated_frac"].as_tensor(torch.float64))
    assert (total, count) == (2.0, 4.0)


class _NoRows:
    """A policy batch on a rank without response tokens (the log-prob gap is then left out)."""

    loss_mask = torch.zeros(0, 0, dtype=torch.bool)
