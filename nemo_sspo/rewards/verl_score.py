"""Our math-verify reward as verl's custom reward function, so the verl route scores as the native one.

verl's default reward picks a scorer by ``data_source`` and has none for our datasets. Name this
module in the config (``examples/integrations/verl/sspo_grpo.yaml``)::

    reward:
      custom_reward_function:
        path: pkg://nemo_sspo.rewards.verl_score
        name: compute_score

verl's reward manager then calls :func:`compute_score` once per response, with the decoded
response and the ``reward_model.ground_truth`` column that ``nemo-sspo data prepare --format
parquet`` writes (the normalised gold answer the native trainer scores against). Scoring runs in
the same :class:`~nemo_sspo.rewards.math_reward.MathVerifyReward` process pool as the native
trainer's, with its per-response deadline: a response that takes longer scores 0.0, as natively.
No verl import happens here.
"""

from __future__ import annotations

import atexit
import threading

from nemo_sspo.rewards.math_reward import MathVerifyReward

__all__ = ["compute_score"]

_lock = threading.Lock()
_reward: MathVerifyReward | None = None


def _shared_reward(num_workers: int, timeout_s: float) -> MathVerifyReward:
    """This process's pool, started at the first call (verl calls from several threads)."""
    global _reward
    with _lock:
        if _reward is None:
            _reward = MathVerifyReward(num_workers=num_workers, timeout_s=timeout_s)
            atexit.register(_reward.close)
        elif (_reward.num_workers, _reward.timeout_s) != (num_workers, float(timeout_s)):
            raise ValueError(f"compute_score: num_workers={num_workers}, timeout_s={timeout_s} differ from the "
                             f"pool already started ({_reward.num_workers}, {_reward.timeout_s}); set them once, "
                             "in reward.custom_reward_function.reward_kwargs")
        return _reward


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
                  num_workers: int = 8, timeout_s: float = 5.0) -> float:
    r"""1.0 if the last ``\boxed{}`` of ``solution_str`` equals ``ground_truth`` (math-verify), else 0.0.

    verl's custom reward signature. ``data_source`` and ``extra_info`` are accepted and unused:
    every row of our parquet files is a math problem with a rule-based answer.

    Args:
        data_source: the row's ``data_source`` (our dataset's ``source``).
        solution_str: the decoded response.
        ground_truth: the row's ``reward_model.ground_truth``.
        extra_info: the row's ``extra_info``.
        num_workers: scoring processes of this process's pool (the native recipes'
            ``reward.options.num_workers``: 8); from ``reward_kwargs`` in verl's config.
        timeout_s: per-response deadline in seconds (``reward.options.timeout_s``: 5.0).

    Raises:
        ValueError: ``num_workers`` or ``timeout_s`` invalid, or different from the first call's.
    """
    return _shared_reward(num_workers, timeout_s)([solution_str], [ground_truth])[0]
