"""Float64 references of the built-in advantage estimators, written apart from the implementation.

Plain Python lists and the ``statistics`` module (no torch): a step's rewards in slot order, split over
``dp`` ranks (rank d owns groups ``[d P/dp, (d+1) P/dp)``) and, per rank, into ``minibatches``
consecutive blocks; the optimizer batch m is every rank's block m (the trainer's mini-batch rows).
"""

from __future__ import annotations

import math
import statistics

EPS = 1e-6


def _groups(rewards: list[float], samples_per_prompt: int) -> list[list[float]]:
    return [rewards[k:k + samples_per_prompt] for k in range(0, len(rewards), samples_per_prompt)]


def _equal(group: list[float]) -> bool:
    return max(group) == min(group)


def optimizer_batch_of_rows(rows: int, dp: int, minibatches: int) -> list[int]:
    """The optimizer batch of every row (slot order) for a split over ``dp`` ranks."""
    per_rank = rows // dp
    block = per_rank // minibatches
    return [(i % per_rank) // block for i in range(rows)]


def reference_advantages(name: str, rewards: list[float], samples_per_prompt: int, *, dp: int = 1, minibatches: int = 1,
                         task_rewards: list[float] | None = None, normalize_std: bool = True,
                         value_logits: list[float] | None = None) -> list[float]:
    """The advantages of every row of the step, in slot order (module docstring)."""
    task = _groups(task_rewards if task_rewards is not None else rewards, samples_per_prompt)
    out: list[float] = []
    if name == "critic":
        for k, group in enumerate(_groups(rewards, samples_per_prompt)):
            baseline = 1.0 / (1.0 + math.exp(-value_logits[k]))
            out += [r - baseline for r in group]
        return out
    centred = []
    for group, task_group in zip(_groups(rewards, samples_per_prompt), task, strict=True):
        mean = statistics.fmean(group)
        if _equal(task_group):
            centred += [0.0] * samples_per_prompt
        elif name == "group":
            scale = statistics.pstdev(group) + EPS if normalize_std else 1.0
            centred += [(r - mean) / scale for r in group]
        elif name == "leave_one_out":  # r_i minus the mean of the others
            centred += [r - (sum(group) - r) / (samples_per_prompt - 1) for r in group]
        else:
            centred += [r - mean for r in group]
    if name != "batch_std":
        return centred
    batch = optimizer_batch_of_rows(len(rewards), dp, minibatches)
    std = {m: statistics.pstdev([c for c, b in zip(centred, batch, strict=True) if b == m])
           for m in set(batch)}
    return [c / (std[b] + EPS) for c, b in zip(centred, batch, strict=True)]
