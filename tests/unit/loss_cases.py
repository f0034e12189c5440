"""The hand-worked values of every registered policy loss, one row per loss name.

Every test that runs over all losses reads its expected values from :data:`LOSS_CASES` and never
names a loss itself, so adding a loss means adding its row here (the tests fail with "add <name>
to tests/unit/loss_cases.py LOSS_CASES" until then). Each row's numbers are worked out by hand from
the loss's docstring at its default config, arithmetic in the comments.

The P3 case (docs/pitfalls.md#p3): 2 rows x 3 tokens, old log-prob -120, log-prob -20, so every
token log-ratio d = 100 and every segment / response mean is 100; old entropy 1, one segment per
row. The mean log-ratio is clamped at 20 before exp: s = e^20 for every ratio unit, and the clamp
passes no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

E20 = math.exp(20.0)


def minus_advantage(advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token loss -A_i of a ratio loss at ratio 1 (``[B]``, ``[B, T]`` -> ``[B, T]``)."""
    return -advantages[:, None].expand_as(logprobs)


def minus_advantage_logprob(advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """-sg(w) A_i log pi_t with w = 1 (CISPO at ratio 1)."""
    return -advantages[:, None] * logprobs


@dataclass(frozen=True)
class LossCase:
    """Hand values of one loss at its default config.

    Attributes:
        p3_plus / p3_minus: per-token loss of the P3 case at A = +1 / A = -1 (0 at A = 0).
        p3_grad_per_advantage: d loss_t / d logprob_t divided by A in the P3 case (0 when the
            clamp and the clip cut the gradient).
        p3_first_token: extra (loss, d loss / d logprob) on token (0, 0) of the P3 case at every A
            (a token-selection penalty).
        on_policy_value: per-token loss at ratio 1, ``f(advantages [B], logprobs [B, T])``; its
            gradient is -A_i at every token for every loss.
        clips_random_batch: the float64 reference batch clips some, not all, tokens.
        selects_random_batch: the float64 reference batch selects at least one token.
        zeroes_random_tokens: the loss sets the loss of a seeded random pick of tokens to 0, so
            its on-policy value in the loop is not ``on_policy_value`` reduced.
    """

    p3_plus: float
    p3_minus: float
    p3_grad_per_advantage: float = 0.0
    p3_first_token: tuple[float, float] = (0.0, 0.0)
    on_policy_value: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = minus_advantage
    clips_random_batch: bool = False
    selects_random_batch: bool = False
    zeroes_random_tokens: bool = False


# A = +1: s is above every upper bound, so psi = b_high * A (the clipped branch, no gradient).
# A = -1: s is above every lower bound, so min(s A, clip(s) A) = s A = -e^20 (loss e^20) unless a
# dual clip caps it at -c A, or the surrogate is bounded by construction.
LOSS_CASES: dict[str, LossCase] = {
    "grpo": LossCase(-1.2, E20, clips_random_batch=True),             # -(1 + eps_high 0.2)
    "dr_grpo": LossCase(-1.2, E20, clips_random_batch=True),
    "dapo": LossCase(-1.28, E20, clips_random_batch=True),            # clip-higher eps_high 0.28
    "gspo": LossCase(-1.0004, E20, clips_random_batch=True),          # eps_high 4e-4
    "gspo_token": LossCase(-1.0004, E20, clips_random_batch=True),
    "sspo_fixed_clip": LossCase(-1.2, E20),                           # eps_high 0.2
    "lpo": LossCase(-1.03, E20, clips_random_batch=True),             # eps 0.03
    "sppo": LossCase(-1.2, 3.0),                                      # dual clip c = 3: -c A = 3
    "sspo": LossCase(-1.75, E20),          # b_high = min(1 + alpha + H, gamma) = min(1 + 0 + 1, 1.75)
    # q = pi_old = e^-120: b_high = min(0.5 + 0.5 sqrt(1 + 4 * 0.28 / q), r_max) = r_max = 10;
    # dual clip c = 10 at A = -1.
    "dcpo": LossCase(-10.0, 10.0, clips_random_batch=True),
    # phi(d) = min(d, 0.4) = 0.4 per token -> s = e^0.4 at A = +1; max(d, -0.4) = 100 -> e^20 at -1.
    "gmpo": LossCase(-math.exp(0.4), E20, clips_random_batch=True),
    # phi(d) = (2 / tau) tanh(tau d / 2) = 2 tanh(50) = 2 (tau_pos = tau_neg = 1) -> s = e^2. The
    # exact gradient A e^2 sech^2(50) / 6 is about 1.8e-43 (the gate is flat).
    "soft_seq_po": LossCase(-math.exp(2.0), math.exp(2.0)),
    # psi = A (1 + (2 / tau) tanh(tau (s - 1) / 2)): A = +1, tau_pos 1 -> 1 + 2 tanh(2.4e8) = 3;
    # A = -1, tau_neg 1.05 -> -(1 + 2 / 1.05).
    "sapo": LossCase(-3.0, 1.0 + 2.0 / 1.05),
    # Clip-Cov: eps 1/1 -> b_high 2 (every Cov_t = 0 is outside the band (1, 5): nothing selected).
    "clip_cov": LossCase(-2.0, E20, selects_random_batch=True, zeroes_random_tokens=True),
    # KL-Cov: unclipped psi = s A; every Cov_t = (lp - mean lp)(A - mean A) = 0; quota
    # max(1, floor(2e-3 * 6)) = 1 token, the tie keeps the first position (0, 0), which gets
    # beta |d| = 1 * 100 on top, with d/d lp = beta sign(d) = 1.
    "kl_cov": LossCase(-E20, E20, p3_first_token=(100.0, 1.0), selects_random_batch=True),
    # CISPO: -sg(clip(s, 1 - 1, 1 + 4)) A log pi_theta = -5 * A * (-20) = 100 A; the detached
    # weight 5 keeps d loss / d lp = -5 A.
    "cispo": LossCase(100.0, -100.0, p3_grad_per_advantage=-5.0,
                      on_policy_value=minus_advantage_logprob, clips_random_batch=True),
}


def loss_case(name: str) -> LossCase:
    """The row of ``name``; fails the test with the fix when the loss has none."""
    if name not in LOSS_CASES:
        pytest.fail(f"policy loss {name!r} has no row of hand values: add {name} to "
                    "tests/unit/loss_cases.py LOSS_CASES")
    return LOSS_CASES[name]


def hand_aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str,
                   max_response_length: int) -> tuple[float, float]:
    """``(loss, denominator)`` of a per-token loss under an aggregation mode, by plain loops.

    With L_i the valid tokens of row i and R the rows with L_i >= 1 (docs/algorithms.md):
    token-mean sum_it / sum_i L_i; seq-mean-token-mean (1/R) sum_i (sum_t / L_i);
    seq-mean-token-sum (1/R) sum_i sum_t; constant-denominator (1/R) sum_i sum_t / L_max.
    """
    rows = [[float(per_token[i, t]) for t in range(mask.shape[1]) if mask[i, t]]
            for i in range(mask.shape[0])]
    rows = [r for r in rows if r]
    tokens, responses = sum(len(r) for r in rows), len(rows)
    if not rows:
        return 0.0, 0.0
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / tokens, float(tokens)
    per_row = {"seq-mean-token-mean": lambda r: sum(r) / len(r),
               "seq-mean-token-sum": sum,
               "constant-denominator": lambda r: sum(r) / max_response_length}[mode]
    return sum(per_row(r) for r in rows) / responses, float(responses)


def token_weights(mask: torch.Tensor, mode: str, max_response_length: int) -> torch.Tensor:
    """d(aggregated loss) / d(per-token loss) at each token (``[B, T]`` float64), by hand: the
    aggregate of a one-hot per-token loss at each valid position."""
    weights = torch.zeros(mask.shape, dtype=torch.float64)
    for i, t in mask.nonzero().tolist():
        one_hot = torch.zeros(mask.shape, dtype=torch.float64)
        one_hot[i, t] = 1.0
        weights[i, t] = hand_aggregate(one_hot, mask, mode, max_response_length)[0]
    return weights
