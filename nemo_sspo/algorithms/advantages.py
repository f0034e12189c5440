"""Group-relative advantages (GRPO, DeepSeekMath arXiv 2402.03300 section 4.1.2; SSPO arXiv
2511.04256 eqs. 3 and 8).

A_i = (r_i - mean_g(r)) / (std_g(r) + eps), shared by every token of response i.

Standard deviation: the papers write std({r_1..r_G}) without saying which estimator. We use the
population std (``unbiased=False``), the literal standard deviation of the G rewards, so each
group's advantages have mean 0 and variance 1 (up to eps). TRL and verl use Bessel's correction
(``unbiased=True``); that only rescales every advantage by sqrt((G-1)/G) (0.935 at G = 8), i.e.
the effective learning rate.
"""

from __future__ import annotations

import torch


def _check_rewards(rewards: torch.Tensor, group_size: int, eps: float) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} rows, not a multiple of group_size={group_size}; "
            "each prompt must own exactly group_size consecutive rows"
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


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B / G]`` bool, True for each group whose G rewards are all equal.

    The test is exact (max == min, not std < tol): such a group's centred rewards are all 0, so
    it carries no learning signal. Rows are grouped consecutively (prompt k owns rows
    ``k*G .. k*G + G - 1``); the caller checks the shapes (``_check_rewards``).
    """
    grouped = rewards.reshape(-1, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    task_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages relative to each prompt's group of responses.

    Rows are grouped consecutively: prompt k owns rows ``k*G .. k*G + G - 1``.

    Args:
        rewards: ``[B]`` float, one scalar reward per response (the task reward plus any shaping).
        group_size: G, responses per prompt; ``B % G`` must be 0.
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
            ``group_size < 1``, ``eps < 0``, or ``task_rewards`` of another shape than ``rewards``
            (or failing the same checks).
    """
    _check_rewards(rewards, group_size, eps)
    if task_rewards is None:
        task_rewards = rewards
    elif task_rewards.shape != rewards.shape:
        raise ValueError(f"task_rewards has shape {tuple(task_rewards.shape)} but rewards has "
                         f"{tuple(rewards.shape)}; pass one task reward per response")
    else:
        _check_rewards(task_rewards, group_size, eps)
    # float64 so that mean/std of large or near-equal rewards lose nothing before the cast.
    grouped = rewards.to(torch.float64).reshape(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    zero_variance = zero_variance_groups(task_rewards, group_size)
    advantages = torch.where(zero_variance.unsqueeze(1), torch.zeros_like(centered), centered)
    stats = {"advantages/zero_variance_group_frac": zero_variance.double().mean().item()}
    return advantages.reshape(-1).to(torch.float32), stats
