"""Truncated importance sampling: hand-worked weights and metrics, and how the loss uses them."""

import math

import pytest
import torch

from nemo_sspo.algorithms.losses import GRPOLossConfig, make_policy_loss
from nemo_sspo.algorithms.micro_batches import MicroBatch
from nemo_sspo.megatron.step import LossSpec, PolicyBatch, _policy_loss_func
from nemo_sspo.rollout import truncated_is_weights


def test_weights_by_hand():
    # Trainer probs [0.5, 0.2, 0.9, 0.3], engine probs [0.25, 0.4, 0.9, 0.1], last token masked out.
    # Ratios [2, 0.5, 1, (3)]; cap 1.5 -> weights [1.5, 0.5, 1, 1 (outside the mask)].
    old = torch.tensor([[0.5, 0.2, 0.9, 0.3]]).log()
    rollout = torch.tensor([[0.25, 0.4, 0.9, 0.1]]).log()
    mask = torch.tensor([[True, True, True, False]])
    weights, metrics = truncated_is_weights(old, rollout, mask, 1.5)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 0.5, 1.0, 1.0]]))
    # mean over the 3 masked tokens: (1.5 + 0.5 + 1) / 3 = 1.0; clipped: 1 of 3
    assert metrics["rollout/tis_weight_mean"].as_tensor().tolist() == pytest.approx([3.0, 3.0])
    assert metrics["rollout/tis_clipped_frac"].as_tensor().tolist() == [1.0, 3.0]


def test_weights_are_constants_and_never_overflow():
    old = torch.tensor([[0.0, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-1000.0, -1.0]])  # ratio e^1000 overflows float32 unless clamped first
    weights, metrics = truncated_is_weights(old, rollout, torch.ones(1, 2, dtype=torch.bool), 2.0)
    assert weights.tolist() == [[2.0, 1.0]] and not weights.requires_grad
    # Ratios [e^1000 (capped at 2), e^0 = 1]: mean weight (2 + 1) / 2 = 1.5, clipped 1 of 2 tokens.
    assert metrics["rollout/tis_weight_mean"].as_tensor().tolist() == [3.0, 2.0]
    assert metrics["rollout/tis_clipped_frac"].as_tensor().tolist() == [1.0, 2.0]


@pytest.mark.parametrize("cap, shape, match", [(0.5, (1, 2), r"^cap=0.5 must be >= 1"), (2.0, (1, 3), "one shape")])
def test_bad_inputs_are_refused(cap, shape, match):
    with pytest.raises(ValueError, match=match):
        truncated_is_weights(torch.zeros(1, 2), torch.zeros(shape), torch.ones(1, 2, dtype=torch.bool), cap)


def _batch(tis_weights):
    # One response of 3 tokens (targets at columns 0..2 of a 4-column row), advantage 1.
    mask = torch.tensor([[True, True, True, False]])
    return PolicyBatch(
        input_ids=torch.zeros(1, 4, dtype=torch.long), position_ids=torch.arange(4)[None],
        targets=torch.tensor([[1, 2, 3, 0]]), loss_mask=mask,
        segment_ids=torch.tensor([[0, 1, 2, -1]]), old_logprobs=torch.full((1, 4), -math.log(5.0)),
        old_entropy=torch.zeros(1, 4), advantages=torch.ones(1), tis_weights=tis_weights)


def _micro(batch):
    return MicroBatch(batch, torch.arange(1), batch.input_ids, batch.position_ids)


def test_policy_loss_is_weighted_per_token():
    spec = LossSpec(loss=make_policy_loss("grpo", GRPOLossConfig(aggregation="token-mean")), tp_group=None,
                    vocab_start=0, vocab_size=5, temperature=1.0, max_response_length=3,
                    output_chunk_size=None)  # the loss reads materialised logits
    logits = torch.zeros(1, 4, 5)  # uniform: log-prob -log 5 = old log-prob, ratio 1, GRPO token loss -A = -1
    plain, count, _ = _policy_loss_func(spec, _micro(_batch(None)), None, logits)
    weighted, count_w, _ = _policy_loss_func(spec, _micro(_batch(torch.tensor([[2.0, 0.5, 1.0, 1.0]]))), None, logits)
    # token-mean numerator: -(1 + 1 + 1) = -3 unweighted; -(2 + 0.5 + 1) = -3.5 weighted; same denominator 3
    assert plain.item() == pytest.approx(-3.0) and weighted.item() == pytest.approx(-3.5)
    assert int(count) == int(count_w) == 3
