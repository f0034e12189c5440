"""The warning when most responses of a step hit rollout.max_new_tokens (they score 0, nothing is learned)."""

from nemo_sspo.trainer.rollout_metrics import TruncationWatch


def test_warns_once_when_more_than_half_are_truncated():
    watch = TruncationWatch(max_new_tokens=64)
    assert watch.check(1, {"response/truncated_frac": 8 / 16}) is None  # exactly half: not "most"
    assert watch.check(2, {"reward/mean": 0.5}) is None  # no truncation metric on this rank
    warning = watch.check(3, {"response/truncated_frac": 9 / 16})  # 9/16 = 56.25%
    assert warning.startswith("step 3: 56% of the responses reached rollout.max_new_tokens=64 without a stop token")
    assert "raise rollout.max_new_tokens" in warning
    assert watch.check(4, {"response/truncated_frac": 1.0}) is None  # once per run
