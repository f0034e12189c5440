"""Loss aggregation modes and the (numerator, denominator) normalisation contract."""

import math

import pytest
import torch

from nemo_sspo.algorithms.aggregation import AGGREGATION_MODES, aggregate


def _lengths_mask(lengths, width):
    return torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def _value(per_token_loss, mask, mode, **kwargs):
    num, den = aggregate(per_token_loss, mask, mode, **kwargs)
    return (num / den).item()


def test_modes_tuple():
    assert AGGREGATION_MODES == (
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant-denominator"
    )


@pytest.mark.parametrize(("mode", "expected"), [
    ("token-mean", 1.0),               # 6 tokens of loss 1 / 6 tokens
    ("seq-mean-token-mean", 1.0),      # (2/2 + 4/4) / 2 responses
    ("seq-mean-token-sum", 3.0),       # (2 + 4) / 2 responses
    ("constant-denominator", 0.75),     # (2/4 + 4/4) / 2 responses (Dr. GRPO, L_max = 4)
])
def test_p13_mode_values(mode, expected):
    # docs/pitfalls.md#p13: lengths [2, 4], every token loss 1, L_max = 4.
    mask = _lengths_mask([2, 4], 4)
    assert _value(torch.ones(2, 4), mask, mode, max_response_length=4) == expected


def test_p10_token_mean_over_micro_batches():
    # docs/pitfalls.md#p10: micro-batch 1 has one token of loss 1, micro-batch 2 three tokens of loss 0:
    # global token mean (1 + 0) / (1 + 3) = 0.25, not the mean of micro-batch means 0.5.
    num1, den1 = aggregate(torch.tensor([[1.0]]), torch.ones(1, 1, dtype=torch.bool), "token-mean")
    num2, den2 = aggregate(torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), "token-mean")
    assert ((num1 + num2) / (den1 + den2)).item() == 0.25


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_split_invariance(mode):
    # Same 4 responses reduced whole or split [1 | 3] and [2 | 2] give one value (docs/pitfalls.md#p10, docs/pitfalls.md#p11).
    gen = torch.Generator().manual_seed(5)
    loss = torch.rand(4, 5, generator=gen, dtype=torch.float64)
    mask = _lengths_mask([5, 1, 0, 3], 5)
    whole = _value(loss, mask, mode, max_response_length=5)
    for cut in (1, 2):
        parts = [aggregate(loss[a:b], mask[a:b], mode, max_response_length=5)
                 for a, b in ((0, cut), (cut, 4))]
        split = sum(p[0] for p in parts) / sum(p[1] for p in parts)
        assert split.item() == pytest.approx(whole, abs=1e-14)


@pytest.mark.parametrize(("mode", "expected", "token_grad"), [
    # (value, d numerator / d loss at each valid token of row 0)
    ("token-mean", 4.0, 1.0),              # (3 + 5) / 2 tokens; numerator 3 + 5
    ("seq-mean-token-mean", 4.0, 0.5),     # ((3 + 5) / 2) / 1 response (the empty one does not
                                           # count); numerator (3 + 5) / 2
    ("seq-mean-token-sum", 8.0, 1.0),      # 8 / 1; numerator 3 + 5
    ("constant-denominator", 2.0, 0.25),   # (8 / 4) / 1; numerator (3 + 5) / L_max 4
])
def test_p12_zero_length_response(mode, expected, token_grad):
    loss = torch.tensor([[3.0, 5.0, math.nan], [math.nan, math.nan, math.nan]],
                        requires_grad=True)
    mask = _lengths_mask([2, 0], 3)
    num, den = aggregate(loss, mask, mode, max_response_length=4)
    assert (num / den).item() == expected
    num.backward()
    # NaN padding and the empty row get exactly 0 (no 0 * NaN).
    assert loss.grad.tolist() == [[token_grad, token_grad, 0.0], [0.0, 0.0, 0.0]]


def test_fully_masked_micro_batch():
    loss = torch.full((2, 3), math.nan, requires_grad=True)
    for mode in AGGREGATION_MODES:
        num, den = aggregate(loss, torch.zeros(2, 3, dtype=torch.bool), mode,
                             max_response_length=3)
        assert num.item() == 0.0 and den.item() == 0.0
        num.backward()
        assert loss.grad.abs().sum() == 0


def test_numerator_gradient_weights():
    # seq-mean-token-mean: d num / d l_it = 1 / L_i: lengths [2, 4] -> 1/2 and 1/4.
    loss = torch.ones(2, 4, requires_grad=True)
    num, _ = aggregate(loss, _lengths_mask([2, 4], 4), "seq-mean-token-mean")
    num.backward()
    assert loss.grad.tolist() == [[0.5, 0.5, 0.0, 0.0], [0.25] * 4]


def test_bad_input_raises():
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="valid modes: .*token-mean"):
        aggregate(torch.ones(1, 2), mask, "sum")
    with pytest.raises(ValueError, match="called 'constant-denominator'"):
        aggregate(torch.ones(1, 2), mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate(torch.ones(1, 2), mask, "constant-denominator")
    with pytest.raises(ValueError, match=r"\(1, 3\).*\(1, 2\)"):
        aggregate(torch.ones(1, 3), mask, "token-mean")
    with pytest.raises(ValueError, match="torch.bool"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "token-mean")
