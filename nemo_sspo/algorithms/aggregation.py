"""Reduction of a per-token loss matrix to a (numerator, denominator) pair.

Normalisation contract: the loss of an optimizer step is ``sum(numerators) / sum(denominators)``
over every micro-batch and data-parallel rank of the step. Returning the pair, instead of a mean,
makes the result independent of how the global batch was split (docs/pitfalls.md#p10: micro-batches with
token losses [1] and [0, 0, 0] give token-mean 1/4, not (1 + 0) / 2). A zero-length response
contributes 0 to the numerator and does not count in the denominator (docs/pitfalls.md#p12).

Modes (L_i = valid tokens of response i, l_it = per-token loss, R = responses with L_i >= 1):

- ``"token-mean"``: sum_it l_it / sum_i L_i  (DAPO).
- ``"seq-mean-token-mean"``: sum_i (1/L_i) sum_t l_it / R  (GRPO; GSPO; SSPO eq. 16).
- ``"seq-mean-token-sum"``: sum_i sum_t l_it / R.
- ``"constant-denominator"``: sum_i (sum_t l_it / L_max) / R  (Dr. GRPO, arXiv 2503.20783
  section 3.2: the constant L_max = max_response_length replaces each response's length; verl
  calls this mode "seq-mean-token-sum-norm").

Under context parallelism (``cp``, :mod:`nemo_sspo.algorithms.cp_context`) each CP rank
holds some positions of every row and returns its share (ours): the numerator sums its own
tokens' terms, each divided by the row's CP-reduced length L_i where the mode divides by it; the
denominator is its own valid tokens for "token-mean", and for the other modes the response count
R on CP rank 0 and 0 on the others. Summed over the CP group both equal the CP = 1 values.
"""

from __future__ import annotations

import torch

from nemo_sspo.algorithms.cp_context import CPContext, cp_sum, items_on_this_rank

AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "constant-denominator",
)
_RENAMED = {"seq-mean-token-sum-norm": "constant-denominator"}


def check_response_matrix(name: str, values: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Checks a per-token matrix against its mask: both ``[B, T]`` with the same shape, the mask bool.

    Args:
        name: what ``values`` is called in the messages (the caller's argument).
        values: ``[B, T]``, any dtype.
        response_mask: ``[B, T]`` bool.

    Raises:
        ValueError: naming ``name`` and both shapes, or the mask's dtype.
    """
    if values.dim() != 2 or values.shape != response_mask.shape:
        raise ValueError(
            f"{name} {tuple(values.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, T] with the same shape"
        )
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be torch.bool, got {response_mask.dtype}")


def _check_inputs(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    max_response_length: int | None,
) -> None:
    if mode not in AGGREGATION_MODES:
        hint = f" (here it is called {_RENAMED[mode]!r})" if mode in _RENAMED else ""
        raise ValueError(f"unknown aggregation mode {mode!r}{hint}; valid modes: "
                         f"{AGGREGATION_MODES}")
    check_response_matrix("per_token_loss", per_token_loss, response_mask)
    if mode == "constant-denominator" and (
        max_response_length is None or max_response_length < 1
    ):
        raise ValueError(
            "mode 'constant-denominator' needs max_response_length >= 1 (the generation "
            f"length cap), got {max_response_length!r}"
        )


def aggregate(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    *,
    max_response_length: int | None = None,
    cp: CPContext | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce ``per_token_loss`` to this micro-batch's share of the step loss.

    Args:
        per_token_loss: ``[B, T]`` float, value to minimise at each token; masked positions are
            never read (they may hold anything).
        response_mask: ``[B, T]`` bool, True at valid response tokens.
        mode: one of :data:`AGGREGATION_MODES` (see the module docstring for the formulas).
        max_response_length: L_max in tokens; required by ``"constant-denominator"`` and read
            by no other mode.
        cp: this rank's share of the sequence under context parallelism (``[B, S_local]``
            inputs; module docstring for how the pair is split), or None.

    Returns:
        ``(numerator, denominator)``: 0-d tensors in the loss dtype; the numerator is
        differentiable, the denominator is a count (valid tokens for ``"token-mean"``, responses
        with >= 1 token otherwise). Sum both over micro-batches and ranks, then divide.

    Raises:
        ValueError: unknown mode (lists the valid ones), shape mismatch, non-bool mask, or missing
            ``max_response_length``.
    """
    _check_inputs(per_token_loss, response_mask, mode, max_response_length)
    zero = torch.zeros((), dtype=per_token_loss.dtype, device=per_token_loss.device)
    token_sums = torch.where(response_mask, per_token_loss, zero).sum(dim=1)
    local_lengths = response_mask.sum(dim=1).to(per_token_loss.dtype)
    if mode == "token-mean":
        return token_sums.sum(), local_lengths.sum()
    lengths = cp_sum(local_lengths, cp)  # the whole row's L_i
    responses = items_on_this_rank((lengths > 0).sum().to(per_token_loss.dtype), cp)
    if mode == "seq-mean-token-mean":
        # clamp: an empty response has token sum 0, so it contributes 0 instead of 0/0.
        return (token_sums / lengths.clamp(min=1)).sum(), responses
    if mode == "seq-mean-token-sum":
        return token_sums.sum(), responses
    return token_sums.sum() / max_response_length, responses
