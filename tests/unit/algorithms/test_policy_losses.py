"""Segment ratios, entropy-adaptive bounds and the ratio-clip loss family (GRPO/GSPO/SSPO).

Expected values are worked by hand (arithmetic in comments) or come from a float64 reference
written directly from SSPO eqs. 9-16 with Python loops over segments.
"""

import math

import pytest
import torch

from nemo_sspo.algorithms.aggregation import aggregate
from nemo_sspo.algorithms.bounds import entropy_adaptive_bounds
from nemo_sspo.algorithms.losses import (
    GRPOLossConfig,
    GSPOLossConfig,
    LossInputs,
    LossRecord,
    LossRequirements,
    SSPOFixedClipConfig,
    SSPOLossConfig,
    compute_policy_loss,
    get_policy_loss,
    make_policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from nemo_sspo.algorithms.ratios import segment_mean

METRIC_KEYS = {
    "policy/clipfrac_tokens", "policy/clipfrac_segments", "policy/b_low", "policy/b_high",
    "policy/ratio", "policy/segments_per_response", "policy/entropy",
}


# The registered loss of each config class used here (the ratio unit is fixed by the loss:
# grpo "token", gspo "response"; sspo and sspo_fixed_clip read the config's segmentation).
LOSS_OF = {GRPOLossConfig: "grpo", GSPOLossConfig: "gspo", SSPOLossConfig: "sspo",
           SSPOFixedClipConfig: "sspo_fixed_clip"}


def _mean(pair):
    return (pair.total / pair.count).item()


def _loss(config, logprobs, old, advantages, mask, segment_ids, entropy):
    """Per-token loss and metrics of the loss registered for ``config``'s class."""
    out = make_policy_loss(LOSS_OF[type(config)], config)(LossInputs(
        logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask,
        segment_ids=segment_ids, old_entropy=entropy))
    return out.per_token_loss, out.metrics


def _run(config, log_ratio, advantages, mask, segment_ids, entropy, dtype=torch.float32):
    """Loss with old logprobs 0, so logprobs equal the token log-ratios; returns grads too."""
    logprobs = log_ratio.to(dtype).clone().requires_grad_(True)
    old = torch.zeros_like(logprobs)
    loss, metrics = _loss(config, logprobs, old, advantages.to(dtype), mask, segment_ids,
                          entropy.to(dtype))
    num, den = aggregate(loss, mask, "seq-mean-token-mean")
    num.backward()
    return loss.detach(), num.detach(), den, logprobs.grad, metrics


# ----------------------------------------------------------------------------- segment_mean

def test_segment_mean_packed_row_p2():
    # docs/pitfalls.md#p2: one packed row holding sequences of lengths [3, 1], log-ratios
    # [.3 .3 .3 | -.9]: per-sequence means [0.3, -0.9], never the row mean (0.9 - 0.9) / 4 = 0.
    values = torch.tensor([[0.3, 0.3, 0.3, -0.9]])
    ids = torch.tensor([[0, 0, 0, 1]])
    mean, length = segment_mean(values, ids, torch.ones(1, 4, dtype=torch.bool))
    assert torch.allclose(mean, torch.tensor([[0.3, 0.3, 0.3, -0.9]]), atol=1e-7)
    assert length.tolist() == [[3.0, 3.0, 3.0, 1.0]]


def test_segment_mean_ignores_masked_inf_and_splits_gradient():
    # Row 0: segment 0 = [1, 3] -> mean 2, segment 1 = [5] -> 5; masked -inf must not leak.
    values = torch.tensor([[1.0, 3.0, 5.0, -math.inf], [2.0, 4.0, math.nan, 0.0]],
                          requires_grad=True)
    ids = torch.tensor([[0, 0, 1, -1], [0, 0, -1, -1]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    mean, length = segment_mean(values, ids, mask)
    assert mean.tolist() == [[2.0, 2.0, 5.0, 0.0], [3.0, 3.0, 0.0, 0.0]]
    assert length.tolist() == [[2.0, 2.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]]
    # d/dv of sum(w * mean), w row0 = [1, 2, 3, 9]: segment 0 tokens get (1 + 2) / 2 = 1.5,
    # token 2 gets 3; masked positions 0. Row 1 w = [4, 6]: (4 + 6) / 2 = 5 each.
    weights = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 6.0, 7.0, 8.0]])
    (mean * weights).sum().backward()
    assert values.grad.tolist() == [[1.5, 1.5, 3.0, 0.0], [5.0, 5.0, 0.0, 0.0]]


def test_segment_mean_shape_mismatch():
    with pytest.raises(ValueError, match=r"\(1, 2\).*\(1, 3\)"):
        segment_mean(torch.zeros(1, 2), torch.zeros(1, 3, dtype=torch.long),
                     torch.ones(1, 2, dtype=torch.bool))


# ----------------------------------------------------------------------------- bounds

def test_bounds_eq14_eq15_hand_values():
    # alpha 0, beta 0.8, gamma 1.75: b_high = min(1 + H, 1.75); b_low = max(0, min(1 - H, 0.8)).
    # H = 0 -> (0.8, 1.0); 0.1 -> (0.8, 1.1); 0.5 -> (0.5, 1.5); 1.2 -> (0 [1-1.2<0], 1.75).
    h = torch.tensor([0.0, 0.1, 0.5, 1.2])
    low, high = entropy_adaptive_bounds(h, alpha=0.0, beta=0.8, gamma=1.75)
    assert torch.allclose(low, torch.tensor([0.8, 0.8, 0.5, 0.0]), atol=1e-7)
    assert torch.allclose(high, torch.tensor([1.0, 1.1, 1.5, 1.75]), atol=1e-7)
    # 7B setting alpha 0.1, gamma 2.2: H = 0 -> 1.1; 0.5 -> 1.6; 1.5 -> min(2.6, 2.2) = 2.2.
    _, high7 = entropy_adaptive_bounds(torch.tensor([0.0, 0.5, 1.5]), alpha=0.1, beta=0.8,
                                       gamma=2.2)
    assert torch.allclose(high7, torch.tensor([1.1, 1.6, 2.2]), atol=1e-7)


def test_bounds_piecewise_hand_values():
    # b_low = clip(1.3 - H, 0.3, 0.8): H 0 -> 1.3 -> 0.8; 0.4 -> 0.9 -> 0.8; 0.7 -> 0.6;
    # 1.2 -> 0.1 -> 0.3.
    low, _ = entropy_adaptive_bounds(torch.tensor([0.0, 0.4, 0.7, 1.2]), alpha=0.0, beta=0.8,
                                     gamma=1.75, lower="piecewise")
    assert torch.allclose(low, torch.tensor([0.8, 0.8, 0.6, 0.3]), atol=1e-7)


def test_bounds_carry_no_gradient_and_reject_unknown_rule():
    h = torch.tensor([0.3], requires_grad=True)
    low, high = entropy_adaptive_bounds(h, alpha=0.0, beta=0.8, gamma=1.75)
    assert not low.requires_grad and not high.requires_grad
    with pytest.raises(ValueError, match="eq15"):
        entropy_adaptive_bounds(h, alpha=0.0, beta=0.8, gamma=1.75, lower="linear")


# ----------------------------------------------------------------------------- SSPO by hand

def test_sspo_hand_worked_loss_gradient_and_metrics():
    # Row 0 (A = +1): segments [t0 t1 | t2 t3], d = [.2, 0 | -.1, -.3], H_t = [.05, .15 | .3, .5]
    #   seg0: s = e^0.1 = 1.105171, H = 0.1 -> b = (min(.9,.8)=.8, min(1.1,1.75)=1.1);
    #         s > 1.1 with A > 0 -> clipped, term 1.1, zero gradient.
    #   seg1: s = e^-0.2 = 0.818731, H = 0.4 -> b = (0.6, 1.4); inside -> term s.
    # Row 1 (A = -1): segments [t0 t1 | t2], d = [-.5, -.5 | .4], H_t = [.1, .1 | 0], t3 masked.
    #   seg0: s = e^-0.5 = 0.606531, b = (0.8, 1.1); s < 0.8 with A < 0 -> clipped, term -0.8.
    #   seg1: s = e^0.4 = 1.491825, H = 0 -> b = (0.8, 1.0); A < 0: min(-s, -1.0) = -s
    #         (upper clip does not cut negative advantages) -> unclipped, gradient flows.
    s0, s1, s2, s3 = math.exp(0.1), math.exp(-0.2), math.exp(-0.5), math.exp(0.4)
    log_ratio = torch.tensor([[0.2, 0.0, -0.1, -0.3], [-0.5, -0.5, 0.4, 0.0]])
    entropy = torch.tensor([[0.05, 0.15, 0.3, 0.5], [0.1, 0.1, 0.0, 9.9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    segments = torch.tensor([[0, 0, 1, 1], [0, 0, 1, -1]])
    adv = torch.tensor([1.0, -1.0])
    loss, num, den, grad, metrics = _run(SSPOLossConfig(), log_ratio, adv, mask, segments,
                                         entropy)
    expected = torch.tensor([[-1.1, -1.1, -s1, -s1], [0.8, 0.8, s3, 0.0]])
    assert torch.allclose(loss, expected, atol=1e-6)
    # eq. 16: row 0 (2*(-1.1) + 2*(-s1)) / 4, row 1 (2*0.8 + s3) / 3, averaged over 2 responses.
    row0, row1 = (2 * -1.1 + 2 * -s1) / 4, (2 * 0.8 + s3) / 3
    assert den.item() == 2.0
    assert num.item() == pytest.approx(row0 + row1, abs=1e-6)
    # eq. 10: every token of an unclipped segment gets the same weight -s*A/|y_i|:
    # row 0 seg1: -s1 / 4 on both tokens; row 1 seg1: +s3 / 3; clipped segments 0.
    expected_grad = torch.tensor([[0.0, 0.0, -s1 / 4, -s1 / 4], [0.0, 0.0, s3 / 3, 0.0]])
    assert torch.allclose(grad, expected_grad, atol=1e-6)
    assert METRIC_KEYS <= set(metrics)  # the full key set is checked in test_loss_family.py
    for value in metrics.values():
        for field in (value.total, value.count):
            # float64: spreads of ratios near 1 are taken from these sums (nemo_sspo.metrics.pairs)
            assert field.shape == () and field.dtype == torch.float64 and not field.requires_grad
    # Clipped: row0 seg0 (2 tokens) and row1 seg0 (2 tokens) of 7 tokens; 2 of 4 segments.
    assert metrics["policy/clipfrac_tokens"].as_tensor().tolist() == [4.0, 7.0]
    assert torch.allclose(metrics["policy/clipfrac_segments"].as_tensor(), torch.tensor([2.0, 4.0]))
    assert torch.allclose(metrics["policy/b_low"].as_tensor(), torch.tensor([0.8 + 0.6 + 0.8 + 0.8, 4.0]))
    assert torch.allclose(metrics["policy/b_high"].as_tensor(), torch.tensor([1.1 + 1.4 + 1.1 + 1.0, 4.0]))
    assert torch.allclose(metrics["policy/ratio"].as_tensor(), torch.tensor([s0 + s1 + s2 + s3, 4.0]))
    assert torch.allclose(metrics["policy/segments_per_response"].as_tensor(), torch.tensor([4.0, 2.0]))
    # Entropy over the 7 valid tokens: .05+.15+.3+.5+.1+.1+0 = 1.2 (the masked 9.9 is ignored).
    assert torch.allclose(metrics["policy/entropy"].as_tensor(), torch.tensor([1.2, 7.0]))


def test_grpo_dual_clip_hand_values():
    # A = -1, eps 0.2, c = 3. Token ratio 4: min(-4, -1.2) = -4 < c*A = -3 -> objective -3,
    # loss 3, gradient 0, counted clipped. Token ratio 2: min(-2, -1.2) = -2 > -3 -> loss 2,
    # d loss / d logprob = s = 2, divided by |y| = 2 after seq-mean-token-mean -> 1.
    log_ratio = torch.tensor([[math.log(4.0), math.log(2.0)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    segments = torch.zeros(1, 2, dtype=torch.long)
    loss, _, _, grad, metrics = _run(GRPOLossConfig(dual_clip_c=3.0), log_ratio,
                                     torch.tensor([-1.0]), mask, segments, torch.zeros(1, 2))
    assert torch.allclose(loss, torch.tensor([[3.0, 2.0]]), atol=1e-6)
    assert torch.allclose(grad, torch.tensor([[0.0, 1.0]]), atol=1e-6)
    assert metrics["policy/clipfrac_tokens"].as_tensor().tolist() == [1.0, 2.0]


# ----------------------------------------------------------------------------- float64 reference

def _reference_objective(logprobs, old, adv, mask, newline_ids, entropy, level, bounds, dual_c):
    """J of SSPO eq. 16 written from eqs. 9-15 with loops; bounds(H) -> (b_low, b_high)."""
    total, responses = 0.0, 0
    for i in range(logprobs.shape[0]):
        tokens = [t for t in range(logprobs.shape[1]) if mask[i, t]]
        if not tokens:
            continue
        responses += 1
        if level == "token":
            groups = [[t] for t in tokens]
        elif level == "sequence":
            groups = [tokens]
        else:
            by_id = {}
            for t in tokens:
                by_id.setdefault(int(newline_ids[i, t]), []).append(t)
            groups = list(by_id.values())
        row = 0.0
        for group in groups:
            s = torch.exp(sum(logprobs[i, t] - old[i, t] for t in group) / len(group))  # eq. 9
            h = sum(float(entropy[i, t]) for t in group) / len(group)  # eq. 13
            low, high = bounds(h)
            term = torch.minimum(s * adv[i], torch.clamp(s, low, high) * adv[i])
            if dual_c is not None and adv[i] < 0:
                term = torch.maximum(term, dual_c * adv[i])
            row = row + len(group) * term
        total = total + row / len(tokens)
    return total / responses


def _sspo_bounds(h):  # eqs. 14-15, alpha 0.1, beta 0.8, gamma 1.3 (small so it binds)
    return max(0.0, min(1.0 - h, 0.8)), min(1.0 + 0.1 + h, 1.3)


CASES = [
    (GRPOLossConfig(eps_low=0.1, eps_high=0.15), "token", lambda h: (0.9, 1.15), None),
    (GRPOLossConfig(dual_clip_c=1.5), "token", lambda h: (0.8, 1.2), 1.5),
    (GSPOLossConfig(eps_low=0.05, eps_high=0.1), "sequence", lambda h: (0.95, 1.1), None),
    (SSPOLossConfig(alpha=0.1, gamma=1.3), "subsentence", _sspo_bounds, None),
    (SSPOFixedClipConfig(eps_low=0.1, eps_high=0.1), "subsentence", lambda h: (0.9, 1.1), None),
]


@pytest.mark.parametrize("seed", [0, 2])
@pytest.mark.parametrize(("config", "level", "bounds", "dual_c"), CASES)
def test_matches_float64_reference(config, level, bounds, dual_c, seed):
    gen = torch.Generator().manual_seed(seed)
    rows, width = 5, 9
    old = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 3
    logprobs = (old + 0.8 * torch.randn(rows, width, generator=gen, dtype=torch.float64))
    logprobs.requires_grad_(True)
    lengths = torch.tensor([9, 6, 1, 0, 4])
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    closes = torch.rand(rows, width, generator=gen) < 0.35
    newline_ids = torch.where(mask, torch.cumsum(closes.long(), 1) - closes.long(), -1)
    adv = torch.tensor([-1.3, 0.7, 0.9, 0.5, -0.4], dtype=torch.float64)
    entropy = torch.rand(rows, width, generator=gen, dtype=torch.float64) * 0.8

    loss, metrics = _loss(config, logprobs, old, adv, mask, newline_ids, entropy)
    num, den = aggregate(loss, mask, "seq-mean-token-mean")
    (grad,) = torch.autograd.grad(num / den, logprobs)

    reference = -_reference_objective(logprobs, old, adv, mask, newline_ids, entropy, level,
                                      bounds, dual_c)
    (ref_grad,) = torch.autograd.grad(reference, logprobs)
    assert (num / den).item() == pytest.approx(reference.item(), abs=1e-12)
    assert torch.allclose(grad, ref_grad, atol=1e-12, rtol=0)
    # Not degenerate: the seeds give some clipped and some unclipped segments for every loss.
    clipped, segments = metrics["policy/clipfrac_segments"].as_tensor().tolist()
    assert 0 < clipped < segments - 0.5


# ----------------------------------------------------------------------------- identities

def _identity_inputs():
    gen = torch.Generator().manual_seed(3)
    log_ratio = 0.3 * torch.randn(3, 6, generator=gen)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], dtype=torch.bool)
    return log_ratio, torch.tensor([1.0, -2.0, 0.5]), mask, torch.rand(3, 6, generator=gen)


@pytest.mark.parametrize(("segments", "other", "eps_low", "eps_high"), [
    (lambda mask: torch.where(mask, 0, -1), GSPOLossConfig, 0.05, 0.08),  # one segment per response
    (lambda mask: torch.where(mask, torch.arange(6).expand(3, 6), -1), GRPOLossConfig, 0.2, 0.28),  # one per token
], ids=["whole_response_is_gspo", "one_token_is_grpo"])
def test_sspo_with_one_segment_per_response_or_per_token_is_gspo_or_grpo(segments, other, eps_low, eps_high):
    log_ratio, adv, mask, entropy = _identity_inputs()
    segment_ids = segments(mask)
    sspo = _run(SSPOFixedClipConfig(eps_low=eps_low, eps_high=eps_high), log_ratio, adv, mask,
                segment_ids, entropy)
    # GSPO and GRPO ignore the segment ids: give them other ones to prove they are not read.
    reference = _run(other(eps_low=eps_low, eps_high=eps_high), log_ratio, adv, mask,
                     torch.zeros_like(segment_ids), entropy)
    for a, b in zip(sspo[:4], reference[:4]):
        assert torch.allclose(a, b, atol=1e-7, rtol=0)


# ----------------------------------------------------------------------------- pitfalls

@pytest.mark.parametrize("name", ["gspo", "sspo"])
def test_p1_response_level_loss_is_zero(name):
    # docs/pitfalls.md#p1: lengths [2, 4], A [+1, -1], ratios 1 -> per-token loss -A.
    # Response-level: (-1 + 1) / 2 = 0. A broadcast-then-token-sum would give -2 + 4 = 2;
    # token-mean 2/6.
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    logprobs = torch.full((2, 4), -1.0, requires_grad=True)
    loss = make_policy_loss(name)(LossInputs(
        logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=torch.tensor([1.0, -1.0]),
        response_mask=mask, segment_ids=torch.where(mask, 0, -1),
        old_entropy=torch.zeros(2, 4))).per_token_loss
    num, den = aggregate(loss, mask, "seq-mean-token-mean")
    assert (num / den).item() == 0.0
    num, den = aggregate(loss, mask, "token-mean")
    assert (num / den).item() == pytest.approx(2 / 6)


def test_p4_segment_ratio_uses_the_mean():
    # docs/pitfalls.md#p4: 8000 tokens at -3.5e-4: exp(mean) = exp(-3.5e-4) = 0.99965,
    # exp(sum) = exp(-2.8) = 0.06.
    mask = torch.ones(1, 8000, dtype=torch.bool)
    log_ratio = torch.full((1, 8000), -3.5e-4)
    one_segment = torch.zeros(1, 8000, dtype=torch.long)
    mean, _ = segment_mean(log_ratio, one_segment, mask)
    assert math.exp(mean[0, 0].item()) == pytest.approx(0.99965, abs=1e-6)
    _, _, _, _, metrics = _run(SSPOLossConfig(), log_ratio, torch.tensor([1.0]), mask,
                               one_segment, torch.zeros(1, 8000))
    assert _mean(metrics["policy/ratio"]) == pytest.approx(0.99965, abs=1e-6)


def test_p5_gspo_clips_small_sequence_ratio_and_reports_it():
    # docs/pitfalls.md#p5: sequence ratio 1.001 (mean log-ratio log 1.001). GSPO bounds
    # [0.9997, 1.0004]: A = +1 row is clipped above (3 tokens); A = -1 row is not (clip only cuts
    # below for A < 0).
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    log_ratio = torch.full((2, 4), math.log(1.001))
    adv = torch.tensor([1.0, -1.0])
    ids = torch.where(mask, 0, -1)
    _, _, _, grad, metrics = _run(GSPOLossConfig(), log_ratio, adv, mask, ids, torch.zeros(2, 4))
    assert metrics["policy/clipfrac_tokens"].as_tensor().tolist() == [3.0, 7.0]
    assert torch.allclose(metrics["policy/clipfrac_segments"].as_tensor(), torch.tensor([1.0, 2.0]))
    # d numerator: row 1 (unclipped) gives each token -s A / |y_1| = 1.001 / 4 (eq. 10); row 0 none.
    torch.testing.assert_close(grad, torch.tensor([[0.0] * 4, [1.001 / 4] * 4]), rtol=1e-6, atol=0.0)
    # With GRPO's eps 0.2 the same ratios are never clipped.
    _, _, _, _, grpo_metrics = _run(GRPOLossConfig(), log_ratio, adv, mask, ids,
                                    torch.zeros(2, 4))
    assert grpo_metrics["policy/clipfrac_tokens"].as_tensor().tolist() == [0.0, 7.0]


def test_p12_empty_response_contributes_nothing():
    # Row 1 is fully masked (and holds NaN padding): loss 0, gradient 0, not a response.
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    log_ratio = torch.tensor([[0.0, 0.0, math.nan], [math.nan, math.nan, math.nan]])
    loss, num, den, grad, metrics = _run(SSPOLossConfig(), log_ratio, torch.tensor([2.0, 5.0]),
                                         mask, torch.where(mask, 0, -1), torch.zeros(2, 3))
    # Row 0: ratio 1, A = 2 -> per-token loss -2, response mean -2; one response.
    assert loss.tolist() == [[-2.0, -2.0, 0.0], [0.0, 0.0, 0.0]]
    assert num.item() == -2.0 and den.item() == 1.0
    # d numerator: row 0 is one segment of 2 tokens with s = 1, each token gets -s A / |y_0| = -2 / 2
    # (eq. 10); the NaN padding and the empty row get exactly 0.
    assert grad.tolist() == [[-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]
    assert torch.allclose(metrics["policy/segments_per_response"].as_tensor(), torch.tensor([1.0, 1.0]))


def test_all_masked_batch_is_finite():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, num, den, grad, metrics = _run(SSPOLossConfig(), torch.zeros(2, 3), torch.ones(2),
                                         mask, torch.full((2, 3), -1), torch.zeros(2, 3))
    assert loss.abs().sum() == 0 and num.item() == 0.0 and den.item() == 0.0
    assert grad.abs().sum() == 0
    assert all(v.as_tensor().tolist() == [0.0, 0.0] for v in metrics.values())


# ----------------------------------------------------------------------------- bad input / registry

def _good_args():
    return dict(logprobs=torch.zeros(2, 4, requires_grad=True), old_logprobs=torch.zeros(2, 4),
                advantages=torch.zeros(2), response_mask=torch.ones(2, 4, dtype=torch.bool),
                segment_ids=torch.zeros(2, 4, dtype=torch.long), old_entropy=torch.zeros(2, 4))


@pytest.mark.parametrize(("field", "bad", "pattern"), [
    ("old_logprobs", torch.zeros(2, 3),
     r"LossInputs\.old_logprobs has shape \(2, 3\) but logprobs has \(2, 4\)"),
    ("advantages", torch.zeros(3), r"LossInputs\.advantages has shape \(3,\).*\[B\] = \[2\]"),
    ("response_mask", torch.ones(2, 5, dtype=torch.bool),
     r"LossInputs\.response_mask has shape \(2, 5\)"),
    ("segment_ids", torch.zeros(1, 4, dtype=torch.long), r"LossInputs\.segment_ids has shape \(1, 4\)"),
    ("old_entropy", torch.zeros(2), r"LossInputs\.old_entropy has shape \(2,\)"),
    ("response_mask", torch.ones(2, 4), r"LossInputs\.response_mask must be torch\.bool"),
])
def test_bad_shapes_and_dtypes_raise(field, bad, pattern):
    args = _good_args()
    args[field] = bad
    with pytest.raises(ValueError, match=pattern):
        LossInputs(**args)


def test_swapped_advantages_and_old_logprobs_raise_naming_advantages():
    # A [B, T] tensor where the [B] advantages belong: the message names LossInputs.advantages.
    args = _good_args()
    args["advantages"] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"LossInputs\.advantages has shape \(2, 4\).*\[B\] = \[2\]"):
        LossInputs(**args)
    # Both swapped (LossInputs(logprobs, advantages, old_logprobs, mask) positionally): still a
    # ValueError naming the [B] field, never a silent broadcast.
    args["old_logprobs"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"LossInputs\.advantages has shape \(2, 4\)"):
        LossInputs(**args)


def test_registry_names_lookup_and_duplicates():
    assert {"grpo", "gspo", "sspo", "sspo_fixed_clip"} <= set(policy_loss_names())
    expected = {"grpo": (GRPOLossConfig, "token"), "gspo": (GSPOLossConfig, "response"),
                "sspo": (SSPOLossConfig, None), "sspo_fixed_clip": (SSPOFixedClipConfig, None)}
    for name, (config_cls, unit) in expected.items():
        record = get_policy_loss(name)
        assert record.name == name and record.config_cls is config_cls
        assert record.unit == unit and record.advantage_source == "group"
    assert get_policy_loss("sspo").reads_old_entropy and not get_policy_loss("grpo").reads_old_entropy
    with pytest.raises(ValueError, match="registered: .*'grpo'.*'sspo'"):
        get_policy_loss("ppo_typo")
    before = get_policy_loss("sspo")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss(LossRecord("sspo", SSPOLossConfig, before.build))
    assert get_policy_loss("sspo") is before and get_policy_loss("sspo").config_cls is SSPOLossConfig


@pytest.mark.parametrize(("make", "pattern"), [
    (lambda: SSPOLossConfig(aggregation="mean"), "valid modes"),
    (lambda: SSPOLossConfig(lower_bound="linear"), "lower_bound"),
    (lambda: SSPOLossConfig(gamma=0.9), "gamma"),
    (lambda: GRPOLossConfig(eps_low=1.2), "eps_low"),
    (lambda: GRPOLossConfig(dual_clip_c=0.5), "dual_clip_c"),
    (lambda: GSPOLossConfig(eps_high=-1.0), "eps_high"),
])
def test_config_validation(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_wrong_config_type_raises():
    with pytest.raises(ValueError, match="'sspo' needs a SSPOLossConfig, got GRPOLossConfig"):
        make_policy_loss("sspo", GRPOLossConfig())
    with pytest.raises(ValueError, match="'sspo' needs a SSPOLossConfig, got dict"):
        make_policy_loss("sspo", {"eps_low": 0.2})


# ----------------------------------------------------------------------------- one-call API

@pytest.mark.parametrize(("name", "params", "expected", "row_grads"), [
    # Ratios 1, so each token's loss is -A_i: row 0 (A = +1, 3 tokens) -1, row 1 (A = -1,
    # 2 tokens) +1. d ratio / d logprob = ratio = 1 inside the clip range, so each valid token's
    # gradient is -A_i over the token's aggregation denominator; padding gets 0.
    ("grpo", {}, 0.0,  # seq-mean-token-mean: (-1 + 1) / 2
     (-1 / (3 * 2), 1 / (2 * 2))),  # -A_i / (L_i * R): -1/6 and +1/4
    ("dapo", {}, -(3 * 1 + 2 * (-1)) / 5,  # token-mean: -0.2
     (-1 / 5, 1 / 5)),  # -A_i / (sum_i L_i = 5)
    ("dr_grpo", {"max_response_length": 4}, ((-3) + 2) / 4 / 2,  # constant-denominator: -0.125
     (-1 / (4 * 2), 1 / (4 * 2))),  # -A_i / (L_max * R): -1/8 and +1/8
])
def test_compute_policy_loss_applies_each_losss_aggregation(name, params, expected, row_grads):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    logprobs = torch.full((2, 4), -0.7, requires_grad=True)
    inputs = LossInputs(logprobs=logprobs, old_logprobs=logprobs.detach().clone(),
                        advantages=torch.tensor([1.0, -1.0]), response_mask=mask)
    loss, metrics = compute_policy_loss(name, inputs, **params)
    assert loss.item() == pytest.approx(expected, abs=1e-7)
    assert metrics["loss/policy"] == pytest.approx(expected, abs=1e-7)
    loss.backward()
    g0, g1 = row_grads
    expected_grad = torch.tensor([[g0, g0, g0, 0.0], [g1, g1, 0.0, 0.0]])
    assert torch.allclose(logprobs.grad, expected_grad, rtol=1e-6, atol=1e-7), logprobs.grad


def test_requirements_read_from_the_registry():
    assert make_policy_loss("sspo").requirements == LossRequirements(
        segmentation="newline", segment_k=None, advantage_source="group", normalize_std=True,
        reference_policy=False, current_entropy=False, old_entropy=True)
    assert make_policy_loss("sppo").requirements.advantage_source == "critic"
    assert make_policy_loss("dr_grpo").requirements.normalize_std is False


@pytest.mark.parametrize("name", policy_loss_names())
@pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
def test_empty_batch_gives_zero_loss_and_gradient(name, shape):
    logprobs = torch.zeros(*shape, requires_grad=True)
    inputs = LossInputs(logprobs=logprobs, old_logprobs=torch.zeros(*shape),
                        advantages=torch.zeros(shape[0]), response_mask=torch.zeros(*shape, dtype=torch.bool),
                        segment_ids=torch.zeros(*shape, dtype=torch.long), old_entropy=torch.zeros(*shape))
    loss, metrics = compute_policy_loss(name, inputs, max_response_length=4)
    loss.backward()
    assert loss.item() == 0.0 and metrics["loss/policy"] == 0.0
    assert logprobs.grad.shape == shape


def test_non_finite_inputs_at_valid_positions_are_named():
    # Row 0 has 2 valid tokens, row 1 one. A NaN advantage on row 0 or a NaN log-prob at a valid
    # token would make the loss NaN: the error names the field. Masked positions may hold NaN: on
    # policy with A = [1, 1], GRPO's loss is -mean over rows of A = -1.
    mask = torch.tensor([[True, True, False], [True, False, False]])
    logprobs = torch.full((2, 3), -1.0)
    with pytest.raises(ValueError, match=r"LossInputs\.advantages holds NaN or inf"):
        compute_policy_loss("grpo", LossInputs(logprobs, logprobs, torch.tensor([math.nan, 1.0]), mask))
    bad = logprobs.clone()
    bad[0, 1] = math.nan  # (an inf log-ratio is clamped, docs/pitfalls.md#p3; NaN cannot be)
    with pytest.raises(ValueError, match=r"LossInputs\.logprobs holds NaN or inf"):
        compute_policy_loss("grpo", LossInputs(bad, logprobs, torch.tensor([1.0, 1.0]), mask))
    bad = logprobs.clone()
    bad[0, 2] = math.nan  # masked
    loss, _ = compute_policy_loss("grpo", LossInputs(bad, logprobs, torch.tensor([1.0, 1.0]), mask))
    assert loss.item() == -1.0
