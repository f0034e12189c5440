"""Math reward: boxed-answer extraction (P17) and math-verify scoring in worker processes (P16)."""

import signal
import time

import pytest

from nemo_sspo.rewards import MathVerifyReward, extract_last_boxed
from nemo_sspo.rewards import math_reward


def _sleep_scorer(response: str, answer: str) -> float:
    time.sleep(30.0)
    return 1.0


def _deaf_scorer(response: str, answer: str) -> float:
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # the worker's own deadline can no longer fire
    time.sleep(30.0)
    return 1.0


class _SleepyReward(MathVerifyReward):
    _scorer = staticmethod(_sleep_scorer)


class _DeafReward(MathVerifyReward):
    _scorer = staticmethod(_deaf_scorer)


@pytest.fixture(scope="module")
def reward():
    with MathVerifyReward(num_workers=2, timeout_s=5.0) as r:
        yield r


def test_extract_nested_braces_p17():
    # A regex stopping at the first '}' would give "\frac{1".
    assert extract_last_boxed("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"


def test_extract_last_boxed_wins_and_fbox():
    assert extract_last_boxed("first \\boxed{3}, corrected: \\boxed{4}") == "4"
    assert extract_last_boxed("\\boxed{3} then \\fbox{5}") == "5"
    assert extract_last_boxed("answer \\boxed {12}") == "12"


def test_extract_none_and_truncated():
    assert extract_last_boxed("the answer is 7") is None
    # The last opening never closes (truncated response): the previous complete box counts.
    assert extract_last_boxed("\\boxed{6} and then \\boxed{\\frac{1}{") == "6"
    assert extract_last_boxed("\\boxed{7") is None


def test_pool_scores_fraction_p16(reward):
    # math-verify inside a thread would fail on SIGALRM and score 0; the pool must give 1.0.
    assert reward(["Step 1\nso \\boxed{\\frac{1}{3}}"], ["1/3"]) == [1.0]


def test_scores_batch(reward):
    responses = [
        "3 + 4 = 7\n\\boxed{7}",          # right
        "3 + 4 = 8\n\\boxed{8}",          # wrong
        "3 + 4 = 7",                       # no box
        "\\boxed{7} no wait \\boxed{9}",  # last box (9) is wrong
        "\\boxed{9} no wait \\boxed{7}",  # last box (7) is right
        "\\boxed{7.0}",                    # numerically equal
    ]
    assert reward(responses, ["7"] * 6) == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_length_mismatch(reward):
    with pytest.raises(ValueError, match="len"):
        reward(["\\boxed{1}"], ["1", "2"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        MathVerifyReward(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifyReward(timeout_s=0)


def test_worker_timeout_scores_zero():
    with _SleepyReward(num_workers=1, timeout_s=0.3) as slow:
        start = time.monotonic()
        assert slow(["\\boxed{1}"], ["1"]) == [0.0]
        assert time.monotonic() - start < 10.0  # far below the scorer's 30 s sleep


def test_unresponsive_worker_is_replaced(monkeypatch):
    # The worker ignores its own deadline, so the parent's deadline (1 round x 0.2 s + 0.5 s) fires.
    monkeypatch.setattr(math_reward, "_GRACE_S", 0.5)
    with _DeafReward(num_workers=1, timeout_s=0.2) as deaf:
        stuck_pool = deaf._pool
        assert deaf(["\\boxed{1}"], ["1"]) == [0.0]
        assert deaf._pool is not stuck_pool
