"""Group-relative advantages (GRPO, DeepSeekMath arXiv 2402.03300 section 4.1.2; SSPO arXiv
2511.04256 eqs. 3 and 8), and DCPO's smooth advantage standardisation.

A_i = (r_i - mean_g(r)) / (std_g(r) + eps), shared by every token of response i.

Standard deviation: the papers write std({r_1..r_G}) without saying which estimator. We use the
population std (``unbiased=False``), the literal standard deviation of the G rewards, so each
group's advantages have mean 0 and variance 1 (up to eps). TRL and verl use Bessel's correction
(``unbiased=True``); that only rescales every advantage by sqrt((G-1)/G) (0.935 at G = 8), i.e.
the effective learning rate.

Smooth advantage standardisation (DCPO, arXiv 2509.02333 section 4.2; official code lime-RL/DCPO,
``verl/trainer/ppo/core_algos.py`` ``get_mean_std`` and ``compute_dcpo_outcome_advantage``): at the
i-th visit of a prompt, its group's mean and unbiased std (mu_new, s_new) are merged with the
prompt's stored cumulative ones (mu_old, s_old) as the official code does::

    mu_cum    = ((i - 1) mu_old + mu_new) / i
    s_cum^2   = [ (i - 1) s_old^2 + s_new^2 + ((i - 1) / i) (mu_new - mu_old)^2 ] / i
    z_new     = (r - mu_new) / s_new,   z_cum = (r - mu_cum) / s_cum   (0 where the std is 0)
    A1 = z_cum / i + (1 - 1/i) z_new,   A2 = z_new / i + (1 - 1/i) z_cum
    A  = A1 where |A1| < |A2|, else A2 (per response)

At i = 1 this is the z-score with the unbiased std and no eps (A1 = A2 = z_new). Without std
normalisation z_new = r - mu_new and z_cum = r - mu_cum, as the official code. A group whose
rewards are all equal gets z_new = 0 but, from its second visit on, z_cum != 0 when the prompt's
earlier rewards differed: such responses keep a learning signal (the paper's point).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PromptRewardStats", "group_advantages", "smooth_group_advantages", "zero_variance_groups"]


def _accepts_group_size(fn: Callable) -> Callable:
    """``fn`` that also takes ``group_size=G``, this keyword's name before ``samples_per_prompt``, as
    ``samples_per_prompt=G`` with a FutureWarning (kept for one release: docs/extending.md).
    """

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "group_size" in kwargs:
            if "samples_per_prompt" in kwargs:
                raise TypeError(f"{fn.__name__}() got group_size= and samples_per_prompt=, the old and new name "
                                "of one argument: pass samples_per_prompt= only")
            warnings.warn(f"{fn.__name__}(group_size=...) is deprecated: pass samples_per_prompt=... (G, "
                          "responses per prompt); group_size= is removed in the next release",
                          FutureWarning, stacklevel=2)
            kwargs["samples_per_prompt"] = kwargs.pop("group_size")
        return fn(*args, **kwargs)

    return call


def _check_rewards(rewards: torch.Tensor, samples_per_prompt: int, eps: float) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if not isinstance(samples_per_prompt, int) or samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be a positive int, got {samples_per_prompt!r}")
    if rewards.numel() % samples_per_prompt != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} rows, not a multiple of samples_per_prompt={samples_per_prompt}; "
            "each prompt must own exactly samples_per_prompt consecutive rows"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    bad = torch.nonzero(~torch.isfinite(rewards)).flatten()
    if bad.numel():
        row = int(bad[0])
        raise ValueError(
            f"rewards[{row}] = {rewards[row].item()} is not finite; the reward function must "
            "return finite numbers"
        )


@_accepts_group_size
def zero_variance_groups(rewards: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """``[B / G]`` bool, True for each group whose G rewards are all equal.

    The test is exact (max == min, not std < tol): such a group's centred rewards are all 0, so
    it carries no learning signal. Rows are grouped consecutively (prompt k owns rows
    ``k*G .. k*G + G - 1``); the caller checks the shapes (``_check_rewards``).
    """
    grouped = rewards.reshape(-1, samples_per_prompt)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


@_accepts_group_size
def group_advantages(
    rewards: torch.Tensor,
    samples_per_prompt: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    task_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages relative to each prompt's group of responses.

    Rows are grouped consecutively: prompt k owns rows ``k*G .. k*G + G - 1``.

    Args:
        rewards: ``[B]`` float, one scalar reward per response (the task reward plus any shaping).
        samples_per_prompt: G, responses per prompt; ``B % G`` must be 0.
        normalize_std: True for GRPO/SSPO (divide by the group's population std + eps); False for
            Dr. GRPO (arXiv 2503.20783: ``A = r - mean_g(r)``).
        eps: added to the std in the denominator.
        task_rewards: ``[B]`` float, the rewards that decide which groups carry a signal; None
            means ``rewards``. A group whose task rewards are all equal gets advantage 0 even when
            shaping terms in ``rewards`` differ: DAPO (arXiv 2503.14476, sec. 3.2 and eq. 11)
            filters groups by accuracy, so its overlong penalty (eq. 13) only ranks responses
            within groups whose task outcomes differ.

    Returns:
        ``(advantages [B] float32, stats)`` with ``stats["advantages/zero_variance_group_frac"]``
        the fraction of groups whose task rewards are all equal. Such groups (and every group
        when G = 1) get advantage exactly 0, never NaN (docs/pitfalls.md#p15).

    Raises:
        ValueError: rewards not 1-D, a non-finite reward (names the row), ``B % G != 0``,
            ``samples_per_prompt < 1``, ``eps < 0``, or ``task_rewards`` of another shape than ``rewards``
            (or failing the same checks).
    """
    _check_rewards(rewards, samples_per_prompt, eps)
    if task_rewards is None:
        task_rewards = rewards
    elif task_rewards.shape != rewards.shape:
        raise ValueError(f"task_rewards has shape {tuple(task_rewards.shape)} but rewards has "
                         f"{tuple(rewards.shape)}; pass one task reward per response")
    else:
        _check_rewards(task_rewards, samples_per_prompt, eps)
    # float64 so that mean/std of large or near-equal rewards lose nothing before the cast.
    grouped = rewards.to(torch.float64).reshape(-1, samples_per_prompt)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    zero_variance = zero_variance_groups(task_rewards, samples_per_prompt)
    advantages = torch.where(zero_variance.unsqueeze(1), torch.zeros_like(centered), centered)
    stats = {"advantages/zero_variance_group_frac": zero_variance.double().mean().item()}
    return advantages.reshape(-1).to(torch.float32), stats


@dataclass(frozen=True)
class PromptRewardStats:
    """One prompt's reward statistics accumulated over its visits (DCPO's per-prompt state).

    Attributes:
        visits: groups of this prompt seen so far (i after the i-th visit), >= 1.
        mean: cumulative mean mu_cum of the rewards (module docstring).
        std: cumulative std s_cum (the official code's merge of unbiased group stds), >= 0.
    """

    visits: int
    mean: float
    std: float


def _merge(old: PromptRewardStats | None, mean: float, std: float) -> PromptRewardStats:
    """The stats after one more visit with group mean/std ``(mean, std)`` (module docstring)."""
    if old is None:
        return PromptRewardStats(1, mean, std)
    i = old.visits + 1
    var = ((i - 1) * old.std**2 + std**2 + (i - 1) / i * (mean - old.mean) ** 2) / i
    return PromptRewardStats(i, ((i - 1) * old.mean + mean) / i, math.sqrt(var))


def _standardised(rewards: torch.Tensor, mean: float, std: float, normalize_std: bool) -> torch.Tensor:
    centred = rewards - mean
    if not normalize_std:
        return centred
    return centred / std if std > 0 else torch.zeros_like(rewards)


@_accepts_group_size
def smooth_group_advantages(
    rewards: torch.Tensor,
    samples_per_prompt: int,
    keys: Sequence[str],
    history: Mapping[str, PromptRewardStats],
    *,
    normalize_std: bool = True,
) -> tuple[torch.Tensor, dict[str, PromptRewardStats]]:
    """DCPO's smooth advantage standardisation (module docstring) for one batch of groups.

    Groups are visited in row order; a prompt that owns two groups of the batch is visited twice
    (the second visit sees the first's stats), so the result depends only on the batch order.

    Args:
        rewards: ``[B]`` float, one scalar reward per response; prompt k owns rows ``k*G .. k*G + G - 1``.
        samples_per_prompt: G >= 2 (the unbiased std of one reward is undefined; the official code refuses it too).
        keys: ``B / G`` stable prompt keys, one per group (e.g. a hash of the problem text).
        history: key -> the prompt's stats before this batch (missing: first visit); not modified.
        normalize_std: divide by the stds (True, the official default); False centres only.

    Returns:
        ``(advantages [B] float32, history after this batch)``: a new dict holding every entry of
        ``history`` plus this batch's updates.

    Raises:
        ValueError: rewards not 1-D, a non-finite reward (names the row), ``B % G != 0``,
            ``samples_per_prompt < 2``, or ``len(keys) != B / G``.
    """
    _check_rewards(rewards, samples_per_prompt, 0.0)
    if samples_per_prompt < 2:
        raise ValueError(f"samples_per_prompt={samples_per_prompt}: the smooth standardisation needs >= 2 "
                         "responses per prompt (an unbiased std of one reward is undefined)")
    grouped = rewards.to(torch.float64).reshape(-1, samples_per_prompt)
    if len(keys) != grouped.shape[0]:
        raise ValueError(f"keys has {len(keys)} entries for {grouped.shape[0]} groups; pass one key per prompt group")
    updated = dict(history)
    rows = []
    for key, group in zip(keys, grouped, strict=True):
        mean_new, std_new = float(group.mean()), float(group.std(unbiased=True))
        stats = _merge(updated.get(key), mean_new, std_new)
        updated[key] = stats
        z_new = _standardised(group, mean_new, std_new, normalize_std)
        z_cum = _standardised(group, stats.mean, stats.std, normalize_std)
        weight = 1.0 / stats.visits
        a1 = weight * z_cum + (1.0 - weight) * z_new
        a2 = weight * z_new + (1.0 - weight) * z_cum
        rows.append(torch.where(a1.abs() < a2.abs(), a1, a2))
    return torch.cat(rows).to(torch.float32), updated
