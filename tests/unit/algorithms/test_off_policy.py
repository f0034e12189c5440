"""Off-policy corrections mu -> pi_old: every mode's weights and metrics against values worked out by
hand, the bounds, overflow, bad inputs, and how the loss uses the weights."""

import math

import pytest
import torch

from nemo_sspo.algorithms.losses import GRPOLossConfig, make_policy_loss
from nemo_sspo.algorithms.micro_batches import MicroBatch
from nemo_sspo.algorithms.off_policy import effective_sample_size, off_policy_weights
from nemo_sspo.megatron.step import LossSpec, PolicyBatch, _policy_loss_func
from nemo_sspo.metrics import merge_metric_sums, summarize_metric_pairs

# Two responses. Only log pi_old - log mu matters, so mu's log-probs are 0 and pi_old's are log r
# (float64: the ratios at the band's edges are exact). Row 0: ratios [2, 0.5, 1] (4th column
# masked), segments [0, 0, 1]; row 1: ratios [3, 6], one segment. Products: row 0 1, row 1 18.
_RATIOS = torch.tensor([[2.0, 0.5, 1.0, 7.0], [3.0, 6.0, 9.0, 9.0]], dtype=torch.float64)
_MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])
_SEGMENTS = torch.tensor([[0, 0, 1, -1], [0, 0, -1, -1]])


def _weights(mode, **bounds):
    return off_policy_weights(mode, _RATIOS.log(), torch.zeros_like(_RATIOS), _MASK, segment_ids=_SEGMENTS, **bounds)


def _value(metrics, key):
    return summarize_metric_pairs(metrics)[key]  # a "mean_sq" pair's summary is the mean square


@pytest.mark.parametrize("mode, bounds, expected, share_key, share, mean, mean_sq", [
    # min(r, 1.5) per token: [1.5, 0.5, 1 | 1.5, 1.5]; mean 6/5, squares (2.25+0.25+1+2.25+2.25)/5 = 8/5;
    # truncated: 2, 3, 6 -> 3 of 5 tokens.
    ("token_tis", dict(cap=1.5), [[1.5, 0.5, 1, 1], [1.5, 1.5, 1, 1]], "rollout/is_truncated_frac", 3 / 5, 1.2, 1.6),
    # min(prod r, 1.5) per response: row 0 min(1, 1.5) = 1, row 1 min(18, 1.5) = 1.5; over 2 responses:
    # mean 1.25, squares (1 + 2.25)/2 = 1.625, truncated 1 of 2.
    ("sequence_tis", dict(cap=1.5), [[1, 1, 1, 1], [1.5, 1.5, 1, 1]], "rollout/is_truncated_frac", 1 / 2, 1.25, 1.625),
    # geometric mean per segment: row 0 sqrt(2 * 0.5) = 1 and 1; row 1 sqrt(18) = 4.24 -> 1.5; per token:
    # mean (1+1+1+1.5+1.5)/5 = 1.2, squares (3 + 2*2.25)/5 = 1.5, truncated 2 of 5 tokens (row 1's).
    ("segment_tis", dict(cap=1.5), [[1, 1, 1, 1], [1.5, 1.5, 1, 1]], "rollout/is_truncated_frac", 2 / 5, 1.2, 1.5),
    # band [0.5, 2.5]: r kept inside, 0 outside -> [2, 0.5, 1 | 0, 0]; mean 3.5/5 = 0.7,
    # squares (4 + 0.25 + 1)/5 = 1.05, masked 2 of 5.
    ("token_mask", dict(low=0.5, high=2.5), [[2, 0.5, 1, 1], [0, 0, 1, 1]], "rollout/is_masked_frac", 2 / 5, 0.7, 1.05),
    # band at the edges [0.5, 2]: 0.5 and 2 are inside (closed band), 3 and 6 outside.
    ("token_mask", dict(low=0.5, high=2.0), [[2, 0.5, 1, 1], [0, 0, 1, 1]], "rollout/is_masked_frac", 2 / 5, 0.7, 1.05),
    # band [0.5, 2.5] on products: row 0 1 inside (weight 1), row 1 18 outside (0); mean 0.5, squares 0.5.
    ("sequence_mask", dict(low=0.5, high=2.5), [[1, 1, 1, 1], [0, 0, 1, 1]], "rollout/is_masked_frac", 1 / 2, 0.5, 0.5),
    # TRL's sequence_mask, low 0 and C = 3: product 18 > 3 masked; with high = 18 (an edge) it is kept.
    ("sequence_mask", dict(low=0.0, high=18.0), [[1, 1, 1, 1], [18, 18, 1, 1]], "rollout/is_masked_frac", 0, 9.5,
     (1 + 324) / 2),
])
def test_weights_and_metrics_by_hand(mode, bounds, expected, share_key, share, mean, mean_sq):
    weights, metrics = _weights(mode, **bounds)
    assert weights.dtype == torch.float32 and not weights.requires_grad
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=0)
    assert _value(metrics, share_key) == pytest.approx(share)
    assert _value(metrics, "rollout/is_weight") == pytest.approx(mean, rel=1e-6)
    assert _value(metrics, "rollout/is_weight_sq") == pytest.approx(mean_sq, rel=1e-6)
    # k3 = r - 1 - ln r per token: row 0 (1 - ln 2) + (-0.5 + ln 2) + 0 = 0.5; row 1 (2 - ln 3) + (5 - ln 6).
    k3 = (0.5 + 7 - math.log(18)) / 5
    assert _value(metrics, "rollout/kl_k3_behaviour") == pytest.approx(k3, rel=1e-6)  # float32 metric pairs


def test_none_is_all_ones_without_metrics():
    weights, metrics = _weights("none")
    assert weights.tolist() == [[1.0] * 4] * 2 and metrics == {}


def test_segment_weights_follow_the_loss_segments():
    # Token segments give token_tis, one segment per response gives the geometric mean over the response.
    tokens = torch.tensor([[0, 1, 2, -1], [0, 1, -1, -1]])
    token_w = off_policy_weights("segment_tis", _RATIOS.log(), torch.zeros_like(_RATIOS), _MASK, segment_ids=tokens,
                                 cap=1.5)[0]
    torch.testing.assert_close(token_w, _weights("token_tis", cap=1.5)[0])
    whole = torch.tensor([[0, 0, 0, -1], [0, 0, -1, -1]])
    whole_w = off_policy_weights("segment_tis", _RATIOS.log(), torch.zeros_like(_RATIOS), _MASK, segment_ids=whole,
                                 cap=10.0)[0]
    # row 0: (2 * 0.5 * 1)^(1/3) = 1; row 1: sqrt(18) = 4.2426 (under the cap 10)
    torch.testing.assert_close(whole_w, torch.tensor([[1, 1, 1, 1], [math.sqrt(18), math.sqrt(18), 1, 1]]))


@pytest.mark.parametrize("mode", ["token_tis", "sequence_tis", "segment_tis", "token_mask", "sequence_mask"])
def test_extreme_ratios_never_overflow(mode):
    old = torch.tensor([[0.0, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-1000.0, -1.0]])  # ratio e^1000 overflows float32 unless bounded first
    weights, metrics = off_policy_weights(mode, old, rollout, torch.ones(1, 2, dtype=torch.bool),
                                          segment_ids=torch.tensor([[0, 1]]), cap=2.0, low=0.5, high=5.0)
    assert torch.isfinite(weights).all() and not weights.requires_grad
    # Truncated: the e^1000 unit weighs C = 2; masked: it weighs 0 (the sequence unit holds both tokens).
    first = {"token_tis": 2.0, "sequence_tis": 2.0, "segment_tis": 2.0, "token_mask": 0.0, "sequence_mask": 0.0}[mode]
    assert weights[0, 0].item() == first
    # k3 at log-ratio 1000 is bounded at log-ratio 80: e^80 - 1 - 80, over 2 tokens.
    assert _value(metrics, "rollout/kl_k3_behaviour") == pytest.approx((math.exp(80) - 81) / 2, rel=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="tis"), "correction='tis' is unknown"),
    (dict(mode="token_tis", cap=0.5), "cap=0.5"),
    (dict(mode="token_mask", low=2.0, high=2.0), "0 <= low < high"),
    (dict(mode="token_mask", low=-0.1, high=2.0), "0 <= low < high"),
    (dict(mode="segment_tis", segment_ids=None), "needs segment_ids"),
    (dict(mode="token_tis", shape=(1, 3)), "one shape"),
])
def test_bad_inputs_are_refused(kwargs, match):
    shape = kwargs.pop("shape", (1, 2))
    with pytest.raises(ValueError, match=match):
        off_policy_weights(kwargs.pop("mode"), torch.zeros(1, 2), torch.zeros(shape),
                           torch.ones(1, 2, dtype=torch.bool), **kwargs)


def test_effective_sample_size():
    # Equal weights: ESS/N = 1. Weights [1.5, 0.5, 1, 1.5, 1.5]: 1.2^2 / 1.6 = 0.9. One of 4 units
    # holding all the weight w: (w/4)^2 / (w^2/4) = 1/4.
    assert effective_sample_size({"rollout/is_weight": 0.7, "rollout/is_weight_sq": 0.49}) == pytest.approx(1.0)
    assert effective_sample_size({"rollout/is_weight": 1.2, "rollout/is_weight_sq": 1.6}) == pytest.approx(0.9)
    assert effective_sample_size({"rollout/is_weight": 3 / 4, "rollout/is_weight_sq": 9 / 4}) == pytest.approx(0.25)
    assert effective_sample_size({"rollout/is_weight": 0.0, "rollout/is_weight_sq": 0.0}) == 0.0
    assert effective_sample_size({}) is None


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


def test_weight_spread_of_1e_7_is_not_lost_to_cancellation():
    # 4,000 token weights 1 + k * 2^-23 (k = -1, 0, 1, 0 repeated; 2^-23 = 1.19e-7, float32's step at 1),
    # from log-ratios of exactly those weights, in two micro-batches: population std
    # sqrt(mean(k^2)) * 2^-23 = sqrt(1/2) * 2^-23 = 8.43e-8, worked out in float64 below.
    # sqrt(E[w^2] - E[w]^2) from float32 means read ~3e-4 here.
    steps = torch.tensor([-1.0, 0.0, 1.0, 0.0], dtype=torch.float64).repeat(1000) * 2.0 ** -23
    weights = (1 + steps).float().reshape(2, 2000)
    old = torch.log(weights.double()).float()
    merged = {}
    for row in range(2):
        mask = torch.ones(1, 2000, dtype=torch.bool)
        _, metrics = off_policy_weights("token_tis", old[row:row + 1], torch.zeros(1, 2000), mask, cap=2.0)
        merged = merge_metric_sums(merged, metrics)
    summary = summarize_metric_pairs(merged)
    reference = weights.double().std(unbiased=False).item()
    assert reference == pytest.approx(math.sqrt(0.5) * 2.0 ** -23, rel=1e-9)
    assert summary["rollout/is_weight_std"] == pytest.approx(reference, rel=1e-3)
    assert summary["rollout/is_weight_sq"] == pytest.approx(weights.double().square().mean().item(), rel=1e-12)
