"""Advantage estimators: the plug-in point ``advantage.name``, and the built-in five.

An estimator turns one step's scalar rewards into one advantage per response (shared by every token
of it). It declares a *scope*, the set of responses whose statistics it reads, one of
:data:`ADVANTAGE_SCOPES`:

- ``group``: the G responses of the row's prompt (always on one data-parallel rank);
- ``optimizer_batch``: the responses of the row's optimizer step, over every data-parallel rank
  (with ``M`` updates per step, rank d's rows ``[m B_d / M, (m + 1) B_d / M)`` of every rank d);
- ``step``: every response of the training step, over every data-parallel rank.

It may ask for per-row values (``row_values``: ``[B, K]`` float64); the host sums them, with a
count of responses, over each row's scope and hands them back as :class:`ScopeStats` (counts, sums
and means per row). :func:`estimate_advantages` does that on one process; the host passes a
``reduce`` that sums the per-scope table over the data-parallel ranks
(``nemo_sspo.parallel.advantage_scope``), so the result depends neither on the data-parallel size,
nor on micro-batching (advantages are computed for the whole step before rows are split), nor on
where rollouts were generated. This module holds no process group.

Built-ins (B rows, G responses per prompt, prompt k owning rows ``k G .. k G + G - 1``):

- ``group``: GRPO's group-normalised advantage (``group_advantages``; DeepSeekMath arXiv 2402.03300
  sec. 4.1.2), ``(r_i - mean_g r) / (std_g r + eps)`` with the population std, or ``r_i - mean_g r``
  when the std switch is off (``normalize_std``; Dr. GRPO's default, arXiv 2503.20783).
- ``leave_one_out``: RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
  Optimization for Learning from Human Feedback in LLMs", arXiv 2402.14740: the RLOO estimator, whose
  baseline for sample i is the mean reward of the other k - 1 samples, after Kool et al. 2019):
  ``A_i = r_i - (1 / (G - 1)) sum_{j != i} r_j`` over the prompt's group, i.e.
  ``G / (G - 1) (r_i - mean_g r)``. No std normalisation (the paper's 1/k average over the samples
  is the loss's aggregation).
- ``batch_std``: group mean, batch std (REINFORCE++ with baseline, Hu et al. 2025, "REINFORCE++:
  Stabilizing Critic-Free Policy Optimization with Global Advantage Normalization", arXiv 2501.03262:
  subtract the prompt group's mean reward, then divide by the std of those centred rewards over the
  global batch): ``A'_i = r_i - mean_g r``, ``A_i = A'_i / (std_b A' + eps)``, std_b the population std
  of A' over the optimizer batch ``b`` (its mean is 0 up to rounding, every group being centred). We
  normalise per response (a response weighs one in the std), not per token as OpenRLHF does.
- ``critic``: SPPO's ``A_i = r_i - sigmoid(V(x_i))`` (``nemo_sspo.algorithms.critic``), V the learned
  prompt value; the host runs the critic and passes its logits.

Every built-in except ``critic`` gives a group whose *task* rewards are all equal advantage exactly
0 (``masks_equal_groups``; DAPO, arXiv 2503.14476 sec. 3.2), whatever its shaped rewards: the
groups DAPO's dynamic sampling refills are exactly those.

Per-prompt history. A ``step``-scope estimator may keep statistics of each prompt across steps: it
gives per-group values (``group_values``: ``[P_local, K]``), the host gathers every rank's groups of the
step in slot order with their prompt keys (:class:`StepGroups`, ``ScopeStats.step_groups``), passes the
history before the step (``AdvantageInputs.history``) and keeps what ``next_history`` returns (the same
on every rank, saved in checkpoints). DCPO's smooth standardisation is such an estimator,
:data:`DCPO_SMOOTH`, registered as ``dcpo_smooth`` (formula in :mod:`nemo_sspo.algorithms.advantages`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import InitVar, dataclass

import torch

from nemo_sspo.algorithms.advantages import (
    PromptRewardStats,
    _accepts_group_size,
    _check_rewards,
    _merge,
    _standardised,
    group_advantages,
    zero_variance_groups,
)
from nemo_sspo.algorithms.critic import critic_advantages
from nemo_sspo.registry import Registry

__all__ = [
    "ADVANTAGE_SCOPES",
    "DCPO_SMOOTH",
    "STD_RULES",
    "AdvantageEstimator",
    "AdvantageInputs",
    "ScopeStats",
    "StepGroups",
    "advantage_estimator_names",
    "estimate_advantages",
    "estimate_advantages_and_history",
    "get_advantage_estimator",
    "register_advantage_estimator",
    "scope_index",
    "scope_table",
    "unregister_advantage_estimator",
]

ADVANTAGE_SCOPES = ("group", "optimizer_batch", "step")
"""What an estimator's statistics range over (module docstring)."""

STD_RULES = ("switch", "always", "never")
"""How an estimator treats the std switch ``normalize_std``: reads it (``switch``), always divides by
a std (``always``: the switch must be on), or never does (``never``: the switch is unread)."""

EPS = 1e-6
"""Added to a std in a denominator (as ``group_advantages``)."""


@dataclass(frozen=True)
class AdvantageInputs:
    """One data-parallel rank's step, as an estimator reads it.

    Attributes:
        rewards: ``[B]`` float, the task reward plus any shaping, rows grouped by prompt.
        task_rewards: ``[B]`` float, the reward function's own scores (decide which groups carry a signal).
        samples_per_prompt: G, responses per prompt (``B % G == 0``).
        normalize_std: the std switch (read by ``std="switch"`` estimators).
        value_logits: ``[B / G]`` the critic's V(x) per prompt, for estimators with ``needs_critic``; else None.
        prompt_keys: ``B / G`` stable keys of the groups' prompts, for estimators with ``group_values``.
        history: key -> the prompt's statistics before this step, for estimators with ``next_history``
            (missing key: first visit; not modified).
    """

    rewards: torch.Tensor
    task_rewards: torch.Tensor
    samples_per_prompt: int
    normalize_std: bool = True
    value_logits: torch.Tensor | None = None
    prompt_keys: Sequence[str] | None = None
    history: Mapping[str, PromptRewardStats] | None = None

    @property
    def group_size(self) -> int:
        """Deprecated: :attr:`samples_per_prompt` by its name before this release (removed in the next)."""
        warnings.warn("AdvantageInputs.group_size is deprecated: read AdvantageInputs.samples_per_prompt (the "
                      "same G, responses per prompt); group_size is removed in the next release",
                      FutureWarning, stacklevel=2)
        return self.samples_per_prompt


@dataclass(frozen=True)
class StepGroups:
    """Every prompt group of the step, over every data-parallel rank, in slot order.

    Attributes:
        keys: ``P`` prompt keys.
        values: ``[P, K]`` float64, the estimator's ``group_values`` of each group.
        first: index of this rank's first group (its groups are ``first .. first + B / G - 1``).
    """

    keys: list[str]
    values: torch.Tensor
    first: int


@dataclass(frozen=True)
class ScopeStats:
    """The sums of an estimator's row values over each row's scope (every rank's rows of that scope).

    Attributes:
        count: ``[B]`` float64, responses in the row's scope.
        sums: ``[B, K]`` float64, the sum of each of the K row values over the row's scope.
        step_groups: the step's groups, for estimators with ``group_values``; else None.
    """

    count: torch.Tensor
    sums: torch.Tensor
    step_groups: StepGroups | None = None

    @property
    def means(self) -> torch.Tensor:
        """``[B, K]`` float64, ``sums / count``."""
        return self.sums / self.count.unsqueeze(1)


@dataclass(frozen=True)
class AdvantageEstimator:
    """One registered estimator (module docstring).

    Attributes:
        name: registry name (``advantage.name``).
        scope: one of :data:`ADVANTAGE_SCOPES`.
        compute: ``compute(inputs, stats) -> [B]`` float advantages; ``stats`` are the scope sums of
            ``row_values`` (K = 0 columns when it is None; ``count`` is always there).
        row_values: ``row_values(inputs) -> [B, K]`` float64 per-row values to sum over the scope, or None.
        needs_critic: the host trains the SPPO critic and passes ``value_logits``.
        masks_equal_groups: a group whose task rewards are all equal gets advantage exactly 0
            (applied by :func:`estimate_advantages`); DAPO dynamic sampling refills those groups.
        min_samples_per_prompt: smallest G the estimator is defined for.
        std: one of :data:`STD_RULES`.
        group_values: ``group_values(inputs) -> [B / G, K]`` float64 per-group values the host gathers
            over the step in slot order (``step`` scope only), or None.
        next_history: ``next_history(step_groups, history) -> dict`` the per-prompt history after the
            step (needs ``group_values``), or None for an estimator without memory.
        min_group_size: deprecated keyword, ``min_samples_per_prompt`` by its name before this release:
            given, it sets ``min_samples_per_prompt`` with a FutureWarning (removed in the next
            release; only the keyword is kept, as :func:`dataclasses.replace` reads an InitVar's attribute:
            read the minimum as ``min_samples_per_prompt``).

    Raises:
        TypeError: ``min_group_size`` and a ``min_samples_per_prompt`` other than the default, which differ.
    """

    name: str
    scope: str
    compute: Callable[[AdvantageInputs, ScopeStats], torch.Tensor]
    row_values: Callable[[AdvantageInputs], torch.Tensor] | None = None
    needs_critic: bool = False
    masks_equal_groups: bool = True
    min_samples_per_prompt: int = 2
    std: str = "never"
    group_values: Callable[[AdvantageInputs], torch.Tensor] | None = None
    next_history: Callable[[StepGroups, Mapping[str, PromptRewardStats]], dict] | None = None
    min_group_size: InitVar[int | None] = None

    def __post_init__(self, min_group_size: int | None) -> None:
        if min_group_size is not None:
            if self.min_samples_per_prompt not in (2, min_group_size):  # 2: the default, i.e. not given
                raise TypeError(f"AdvantageEstimator({self.name!r}) got min_group_size={min_group_size} and "
                                f"min_samples_per_prompt={self.min_samples_per_prompt}, the old and new name of one "
                                "argument: pass min_samples_per_prompt= only")
            warnings.warn("AdvantageEstimator(min_group_size=...) is deprecated: pass min_samples_per_prompt=... "
                          "(the smallest G, responses per prompt); min_group_size is removed in the next release",
                          FutureWarning, stacklevel=3)
            object.__setattr__(self, "min_samples_per_prompt", min_group_size)



_REGISTRY: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", hint=" (a module of the config key plugins may register one)")


def register_advantage_estimator(estimator: AdvantageEstimator) -> AdvantageEstimator:
    """Adds ``estimator`` to the registry; returns it.

    Raises:
        ValueError: the name is taken, an unknown scope or std rule, ``min_samples_per_prompt < 1``, or
            ``group_values`` / ``next_history`` outside their rules (``AdvantageEstimator``).
    """
    _check_estimator(estimator)
    return _REGISTRY.add(estimator.name, estimator)


def _check_estimator(estimator: AdvantageEstimator) -> None:
    if estimator.scope not in ADVANTAGE_SCOPES:
        raise ValueError(f"advantage estimator {estimator.name!r}: scope={estimator.scope!r}; valid: "
                         f"{', '.join(ADVANTAGE_SCOPES)}")
    if estimator.std not in STD_RULES:
        raise ValueError(f"advantage estimator {estimator.name!r}: std={estimator.std!r}; valid: "
                         f"{', '.join(STD_RULES)}")
    least = estimator.min_samples_per_prompt
    if isinstance(least, bool) or not isinstance(least, int) or least < 1:
        raise ValueError(f"advantage estimator {estimator.name!r}: min_samples_per_prompt={least!r} "
                         "must be an int >= 1")
    if estimator.group_values is not None and estimator.scope != "step":
        raise ValueError(f"advantage estimator {estimator.name!r}: group_values needs scope='step' (the host "
                         f"gathers the whole step's groups), got scope={estimator.scope!r}")
    if estimator.next_history is not None and estimator.group_values is None:
        raise ValueError(f"advantage estimator {estimator.name!r}: next_history reads the step's groups; "
                         "give group_values too")


def unregister_advantage_estimator(name: str) -> AdvantageEstimator:
    """Removes and returns the estimator ``name`` (tests and temporary plug-ins).

    Raises:
        ValueError: ``name`` is not registered.
    """
    return _REGISTRY.remove(name)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``.

    Raises:
        ValueError: unknown name (``name=...``), listing the registered ones.
    """
    return _REGISTRY.get(name)


def advantage_estimator_names() -> list[str]:
    """Sorted names of the registered estimators."""
    return _REGISTRY.names()


# ---- scopes --------------------------------------------------------------------------------------

@_accepts_group_size
def scope_index(rows: int, samples_per_prompt: int, scope: str, minibatches: int = 1) -> tuple[torch.Tensor, int]:
    """Each local row's scope id and the number of scopes.

    Args:
        rows: B, this rank's rows (whole prompt groups, in slot order).
        samples_per_prompt: G.
        scope: one of :data:`ADVANTAGE_SCOPES`.
        minibatches: M, optimizer steps per training step (consecutive blocks of ``B / M`` rows).

    Returns:
        ``([B] int64 ids in [0, S), S)``: ``group``: the prompt (S = B / G, local to the rank);
        ``optimizer_batch``: the block ``i // (B / M)`` (S = M, the same ids on every rank);
        ``step``: 0 (S = 1).

    Raises:
        ValueError: unknown scope, ``B % G != 0`` or ``B % M != 0``.
    """
    if scope not in ADVANTAGE_SCOPES:
        raise ValueError(f"scope={scope!r}; valid: {', '.join(ADVANTAGE_SCOPES)}")
    if samples_per_prompt < 1 or rows % samples_per_prompt:
        raise ValueError(f"rows={rows} must be a multiple of samples_per_prompt={samples_per_prompt}")
    if minibatches < 1 or rows % minibatches:
        raise ValueError(f"rows={rows} must split into minibatches={minibatches} equal blocks")
    position = torch.arange(rows)
    if scope == "group":
        return position // samples_per_prompt, rows // samples_per_prompt
    if scope == "optimizer_batch":
        return position // (rows // minibatches), minibatches
    return torch.zeros(rows, dtype=torch.int64), 1


def scope_table(values: torch.Tensor, index: torch.Tensor, num_scopes: int) -> torch.Tensor:
    """``[S, 1 + K]`` float64: per scope, the row count then the sums of ``values`` ``[B, K]``."""
    table = torch.zeros(num_scopes, 1 + values.shape[1], dtype=torch.float64)
    rows = torch.cat([torch.ones(values.shape[0], 1, dtype=torch.float64), values.to(torch.float64)], dim=1)
    return table.index_add_(0, index, rows)


def estimate_advantages(estimator: AdvantageEstimator, inputs: AdvantageInputs, *, minibatches: int = 1,
                        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        gather: Callable[[object], tuple[list, int]] | None = None) -> torch.Tensor:
    """``[B]`` float32 advantages of this rank's rows by ``estimator`` (one without ``next_history``).

    Args:
        estimator: a registered estimator.
        inputs: this rank's step (``AdvantageInputs``).
        minibatches: M, optimizer steps per training step (the ``optimizer_batch`` scope's blocks).
        reduce: sums a ``[S, 1 + K]`` float64 scope table over the data-parallel ranks (the same S
            scopes on each: ``optimizer_batch`` and ``step`` scopes); None on one rank. Never called for
            ``group`` scopes (a group lives on one rank).
        gather: ``gather(obj) -> (every rank's obj in data-parallel order, this rank's index)``, for
            estimators with ``group_values``; None on one rank.

    Raises:
        ValueError: bad rewards (``_check_rewards``), ``G < estimator.min_samples_per_prompt``, a critic
            estimator without ``value_logits``, missing ``prompt_keys``, row or group values or
            advantages of the wrong shape, or an estimator with ``next_history`` (use
            :func:`estimate_advantages_and_history`, which returns the history).
    """
    if estimator.next_history is not None:
        raise ValueError(f"advantage estimator {estimator.name!r} keeps a per-prompt history: call "
                         "estimate_advantages_and_history, which returns it")
    return estimate_advantages_and_history(estimator, inputs, minibatches=minibatches, reduce=reduce,
                                           gather=gather)[0]


def estimate_advantages_and_history(
    estimator: AdvantageEstimator, inputs: AdvantageInputs, *, minibatches: int = 1,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    gather: Callable[[object], tuple[list, int]] | None = None,
) -> tuple[torch.Tensor, dict[str, PromptRewardStats] | None]:
    """``([B] float32 advantages, history after the step or None)``: :func:`estimate_advantages` for any
    estimator; the history is ``next_history``'s (None for an estimator without one).

    Raises:
        ValueError: as :func:`estimate_advantages` (but accepts estimators with ``next_history``).
    """
    rewards, samples_per_prompt = inputs.rewards, inputs.samples_per_prompt
    _check_rewards(rewards, samples_per_prompt, 0.0)
    _check_rewards(inputs.task_rewards, samples_per_prompt, 0.0)
    if samples_per_prompt < estimator.min_samples_per_prompt:
        raise ValueError(f"advantage estimator {estimator.name!r} needs samples_per_prompt >= "
                         f"{estimator.min_samples_per_prompt}, got {samples_per_prompt}")
    if estimator.needs_critic and inputs.value_logits is None:
        raise ValueError(f"advantage estimator {estimator.name!r} reads the critic: pass value_logits")
    rows = rewards.numel()
    values = (estimator.row_values(inputs) if estimator.row_values is not None
              else torch.zeros(rows, 0, dtype=torch.float64))
    if values.dim() != 2 or values.shape[0] != rows:
        raise ValueError(f"advantage estimator {estimator.name!r}: row_values gave shape {tuple(values.shape)}, "
                         f"expected [{rows}, K]")
    index, num_scopes = scope_index(rows, samples_per_prompt, estimator.scope, minibatches)
    table = scope_table(values, index, num_scopes)
    if reduce is not None and estimator.scope != "group":
        table = reduce(table)
    step_groups = _step_groups(estimator, inputs, gather) if estimator.group_values is not None else None
    stats = ScopeStats(count=table[index, 0], sums=table[index, 1:], step_groups=step_groups)
    advantages = estimator.compute(inputs, stats)
    if tuple(advantages.shape) != (rows,):
        raise ValueError(f"advantage estimator {estimator.name!r} returned shape {tuple(advantages.shape)}, "
                         f"expected [{rows}]")
    advantages = advantages.to(torch.float32)
    if estimator.masks_equal_groups:
        equal = zero_variance_groups(inputs.task_rewards, samples_per_prompt).repeat_interleave(samples_per_prompt)
        advantages = torch.where(equal, torch.zeros_like(advantages), advantages)
    history = None
    if estimator.next_history is not None:
        history = estimator.next_history(step_groups, inputs.history or {})
    return advantages, history


def _step_groups(estimator: AdvantageEstimator, inputs: AdvantageInputs, gather) -> StepGroups:
    """The step's groups in slot order (every rank's, by ``gather``)."""
    groups = inputs.rewards.numel() // inputs.samples_per_prompt
    keys = list(inputs.prompt_keys) if inputs.prompt_keys is not None else None
    if keys is None or len(keys) != groups:
        raise ValueError(f"advantage estimator {estimator.name!r} reads the prompt keys: pass prompt_keys, "
                         f"one per group ({groups}), got {None if keys is None else len(keys)}")
    values = estimator.group_values(inputs).to(torch.float64)
    if values.dim() != 2 or values.shape[0] != groups:
        raise ValueError(f"advantage estimator {estimator.name!r}: group_values gave shape "
                         f"{tuple(values.shape)}, expected [{groups}, K]")
    parts, mine = gather((keys, values)) if gather is not None else ([(keys, values)], 0)
    first = sum(len(part_keys) for part_keys, _ in parts[:mine])
    return StepGroups(keys=[key for part_keys, _ in parts for key in part_keys],
                      values=torch.cat([part_values for _, part_values in parts]), first=first)


# ---- built-ins -----------------------------------------------------------------------------------

def _group(inputs: AdvantageInputs, stats: ScopeStats) -> torch.Tensor:
    """GRPO / Dr. GRPO (module docstring): ``group_advantages`` with the loss's std switch."""
    advantages, _ = group_advantages(inputs.rewards, inputs.samples_per_prompt, task_rewards=inputs.task_rewards,
                                     normalize_std=inputs.normalize_std, eps=EPS)
    return advantages


def _rewards_column(inputs: AdvantageInputs) -> torch.Tensor:
    return inputs.rewards.to(torch.float64).unsqueeze(1)


def _leave_one_out(inputs: AdvantageInputs, stats: ScopeStats) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other G - 1 rewards of its group (scope sums of r)."""
    rewards = inputs.rewards.to(torch.float64)
    return rewards - (stats.sums[:, 0] - rewards) / (stats.count - 1)


def _group_centred(inputs: AdvantageInputs) -> torch.Tensor:
    """``[B]`` float64 r_i - mean_g(r), 0 for groups whose task rewards are all equal."""
    grouped = inputs.rewards.to(torch.float64).reshape(-1, inputs.samples_per_prompt)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    equal = zero_variance_groups(inputs.task_rewards, inputs.samples_per_prompt).repeat_interleave(
        inputs.samples_per_prompt)
    return torch.where(equal, torch.zeros_like(centred), centred)


def _centred_moments(inputs: AdvantageInputs) -> torch.Tensor:
    centred = _group_centred(inputs)
    return torch.stack([centred, centred * centred], dim=1)


def _batch_std(inputs: AdvantageInputs, stats: ScopeStats) -> torch.Tensor:
    """REINFORCE++-baseline: the group-centred reward over the batch's population std of it."""
    mean, mean_sq = stats.means[:, 0], stats.means[:, 1]
    std = (mean_sq - mean * mean).clamp_min(0.0).sqrt()
    return _group_centred(inputs) / (std + EPS)


def _critic(inputs: AdvantageInputs, stats: ScopeStats) -> torch.Tensor:
    """SPPO: r_i - sigmoid(V(x_i))."""
    return critic_advantages(inputs.rewards, inputs.value_logits, inputs.samples_per_prompt)


register_advantage_estimator(AdvantageEstimator("group", "group", _group, std="switch"))
register_advantage_estimator(AdvantageEstimator("leave_one_out", "group", _leave_one_out,
                                                row_values=_rewards_column))
register_advantage_estimator(AdvantageEstimator("batch_std", "optimizer_batch", _batch_std,
                                                row_values=_centred_moments, std="always"))
register_advantage_estimator(AdvantageEstimator("critic", "group", _critic, needs_critic=True,
                                                masks_equal_groups=False, min_samples_per_prompt=1))


# ---- DCPO's smooth standardisation (formula: nemo_sspo.algorithms.advantages) ------------------------

def _group_mean_std(inputs: AdvantageInputs) -> torch.Tensor:
    """``[B / G, 2]`` float64: each group's mean and unbiased std (as the official code)."""
    grouped = inputs.rewards.to(torch.float64).reshape(-1, inputs.samples_per_prompt)
    return torch.tensor([[float(group.mean()), float(group.std(unbiased=True))] for group in grouped],
                        dtype=torch.float64).reshape(-1, 2)


def _visits(groups: StepGroups, history: Mapping[str, PromptRewardStats]):
    """Each group's prompt statistics after its visit (slot order), and the history after the step."""
    updated, merged = dict(history), []
    for key, (mean, std) in zip(groups.keys, groups.values.tolist(), strict=True):
        updated[key] = _merge(updated.get(key), mean, std)
        merged.append(updated[key])
    return merged, updated


def _dcpo_smooth(inputs: AdvantageInputs, stats: ScopeStats) -> torch.Tensor:
    """A = the smaller-magnitude mix of z_new and z_cum per response (``smooth_group_advantages``)."""
    groups = stats.step_groups
    merged, _ = _visits(groups, inputs.history or {})
    grouped = inputs.rewards.to(torch.float64).reshape(-1, inputs.samples_per_prompt)
    rows = []
    for j, group in enumerate(grouped):
        mean_new, std_new = groups.values[groups.first + j].tolist()
        visit = merged[groups.first + j]
        z_new = _standardised(group, mean_new, std_new, inputs.normalize_std)
        z_cum = _standardised(group, visit.mean, visit.std, inputs.normalize_std)
        weight = 1.0 / visit.visits
        a1 = weight * z_cum + (1.0 - weight) * z_new
        a2 = weight * z_new + (1.0 - weight) * z_cum
        rows.append(torch.where(a1.abs() < a2.abs(), a1, a2))
    return torch.cat(rows)


DCPO_SMOOTH = register_advantage_estimator(AdvantageEstimator(
    "dcpo_smooth", "step", _dcpo_smooth, masks_equal_groups=False, std="switch", group_values=_group_mean_std,
    next_history=lambda groups, history: _visits(groups, history)[1]))
"""DCPO's smooth standardisation (arXiv 2509.02333 sec. 4.2) as a history-keeping estimator, registered
as ``dcpo_smooth``: the group statistics of each prompt mixed with those of its earlier visits.
Groups whose rewards are all equal keep ``z_cum`` (DCPO's point), so ``masks_equal_groups`` is off."""
