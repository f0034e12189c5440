"""The comparison family of policy losses: hand-worked values, float64 references written from each
paper's formula (Python loops, never the code under test), identities between losses, and the
failure classes of docs/pitfalls.md that concern losses (docs/pitfalls.md#p1, #p3, #p12) for every
registered name, whose hand values come from one table (tests/unit/loss_cases.py).

Helpers: `_loss` calls a registered loss with old log-probs `old` (default 0, so logprobs are the
token log-ratios) and returns (per-token loss, numerator, denominator, d(num/den)/d logprobs,
metrics) under the config's own aggregation mode.
"""

import math

import pytest
import torch

from nemo_sspo.algorithms.aggregation import aggregate
from nemo_sspo.algorithms.losses import (
    LossInputs,
    compute_policy_loss,
    get_policy_loss,
    make_policy_loss,
    policy_loss_names,
)
from tests.unit.loss_cases import E20, LOSS_CASES, hand_aggregate, loss_case, token_weights

LN3 = math.log(3.0)


def _loss(name, logprobs, adv, mask, *, old=None, segments=None, old_entropy=None, l_max=None,
          **params):
    config = get_policy_loss(name).config_cls(**params)
    logprobs = logprobs.clone().requires_grad_(True)
    old = torch.zeros_like(logprobs) if old is None else old
    segments = torch.where(mask, 0, -1) if segments is None else segments
    old_entropy = torch.zeros_like(logprobs) if old_entropy is None else old_entropy
    out = make_policy_loss(name, config)(LossInputs(
        logprobs=logprobs, old_logprobs=old, advantages=adv.to(logprobs.dtype), response_mask=mask,
        segment_ids=segments, old_entropy=old_entropy))
    loss, metrics = out.per_token_loss, out.metrics
    num, den = aggregate(loss, mask, config.aggregation,
                         max_response_length=l_max or logprobs.shape[1])
    (num / den.clamp(min=1)).backward()  # clamp: a fully masked batch has 0 / 0
    return loss.detach(), num.detach(), den, logprobs.grad, metrics


def _frac(pair):
    return (pair.total / pair.count).item()


# ----------------------------------------------------------------------------- hand-worked values

TWO_ROWS_MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
# Row 0 (A = +1) token ratios [1.1, 1.5]; row 1 (A = -1) token ratios [0.5, 1.5, 1, 1].
TWO_ROWS_LOG_RATIO = torch.log(torch.tensor([[1.1, 1.5, 1.0, 1.0], [0.5, 1.5, 1.0, 1.0]]))
TWO_ROWS_ADV = torch.tensor([1.0, -1.0])


def test_dr_grpo_constant_denominator_hand_values():
    # Clip [0.8, 1.2]. Row 0: 1.1 inside -> -1.1; 1.5 > 1.2 with A > 0 -> -1.2 (clipped).
    # Row 1: 0.5 < 0.8 with A < 0 -> min(-0.5, -0.8) = -0.8 -> loss 0.8 (clipped); 1.5 -> 1.5;
    # 1 -> 1; 1 -> 1. L_max = 5: ((-1.1 - 1.2) / 5 + (0.8 + 1.5 + 1 + 1) / 5) / 2 = 0.2.
    loss, num, den, grad, metrics = _loss("dr_grpo", TWO_ROWS_LOG_RATIO, TWO_ROWS_ADV,
                                          TWO_ROWS_MASK, l_max=5)
    assert torch.allclose(loss, torch.tensor([[-1.1, -1.2, 0, 0], [0.8, 1.5, 1, 1]]), atol=1e-6)
    assert (num / den).item() == pytest.approx(0.2, abs=1e-6)
    # d loss_t / d logprob_t = -r A for unclipped tokens, divided by L_max * responses = 10.
    expected = torch.tensor([[-0.11, 0.0, 0, 0], [0.0, 0.15, 0.1, 0.1]])
    assert torch.allclose(grad, expected, atol=1e-6)
    assert get_policy_loss("dr_grpo").normalize_std is False
    assert metrics["policy/clipfrac_tokens"].as_tensor().tolist() == [2.0, 6.0]


def test_dapo_clip_higher_token_mean_hand_values():
    # Clip [0.8, 1.28]: row 0 1.5 -> 1.28. Token mean over 6 tokens:
    # (-1.1 - 1.28 + 0.8 + 1.5 + 1 + 1) / 6 = 1.92 / 6 = 0.32.
    loss, num, den, grad, _ = _loss("dapo", TWO_ROWS_LOG_RATIO, TWO_ROWS_ADV, TWO_ROWS_MASK)
    assert den.item() == 6.0
    assert (num / den).item() == pytest.approx(0.32, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-1.1, 0, 0, 0], [0, 1.5, 1, 1]]) / 6, atol=1e-6)


def test_dcpo_bounds_hand_values():
    # eps_low 0.16, eps_high 0.2; b_high = 0.5 + 0.5 sqrt(1 + 0.8 / q) capped at 10,
    # b_low = 0.5 + 0.5 sqrt(max(1 - 0.64 / q, 0)):
    # q = 1: 0.5 + 0.5 sqrt(1.8) = 1.170820, 0.5 + 0.5 * 0.6 = 0.8
    # q = 0.8: sqrt(2) -> 1.207107, sqrt(0.2) -> 0.723607
    # q = 0.1: sqrt(9) -> 2.0, 0.5 (1 - 6.4 < 0); q = 0.01: sqrt(81) -> 5.0; q = 1e-3 -> 10 (cap)
    q = torch.tensor([[1.0, 0.8, 0.1, 0.01, 1e-3]], dtype=torch.float64)
    mask = torch.ones(1, 5, dtype=torch.bool)
    # Ratios far above every bound with A > 0: each token's objective is its upper bound.
    # (eps set explicitly: the paper's table values; the defaults are the shipped run's.)
    loss, _, _, grad, metrics = _loss("dcpo", torch.log(q) + 5.0, torch.tensor([1.0]), mask,
                                      old=torch.log(q), eps_low=0.16, eps_high=0.2)
    b_high = torch.tensor([[1.170820, 1.207107, 2.0, 5.0, 10.0]], dtype=torch.float64)
    assert torch.allclose(-loss, b_high, atol=1e-6)
    assert grad.abs().sum() == 0
    # Ratios far below with A < 0: objective -b_low, loss b_low.
    loss, _, _, _, _ = _loss("dcpo", torch.log(q) - 5.0, torch.tensor([-1.0]), mask,
                             old=torch.log(q), eps_low=0.16, eps_high=0.2)
    assert torch.allclose(loss, torch.tensor([[0.8, 0.723607, 0.5, 0.5, 0.5]],
                                             dtype=torch.float64), atol=1e-6)
    assert metrics["policy/b_high"].total.item() == pytest.approx(b_high.sum().item(), abs=1e-5)


def test_dcpo_defaults_are_the_shipped_run():
    # lime-RL/DCPO recipe/dcpo/run_dcpo.sh over run_base.sh: eps_low 0.2, eps_high 0.28,
    # clip_type dynamic with clip_ratio_c 10 (upper cap max(c, 10) = 10, dual clip c = 10 for
    # A < 0), "only-token-mean" = token mean.
    # q = 0.5: b_high = 0.5 + 0.5 sqrt(1 + 4 * 0.28 / 0.5) = 0.5 + 0.5 sqrt(3.24) = 1.4;
    #          b_low = 0.5 + 0.5 sqrt(1 - 4 * 0.2 / 0.5) = 0.5 + 0.5 sqrt(-0.6 -> 0) = 0.5.
    # q = 1:   b_high = 0.5 + 0.5 sqrt(2.12) = 1.228011; b_low = 0.5 + 0.5 sqrt(0.2) = 0.723607.
    cfg = get_policy_loss("dcpo").config_cls()
    assert (cfg.eps_low, cfg.eps_high, cfg.ratio_max, cfg.dual_clip_c) == (0.2, 0.28, 10.0, 10.0)
    assert cfg.aggregation == "token-mean"
    q = torch.tensor([[0.5, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _, _, _, _ = _loss("dcpo", torch.log(q) + 5.0, torch.tensor([1.0]), mask,
                             old=torch.log(q))
    assert torch.allclose(-loss, torch.tensor([[1.4, 1.228011]], dtype=torch.float64), atol=1e-6)
    # A = -1 and ratio e^5 = 148.4 above every bound: the min keeps -r A = 148.4 as loss, the
    # dual clip caps it at -c A = 10 (no gradient). Ratio e^-5 stays at -b_low A = b_low.
    loss, _, _, grad, metrics = _loss("dcpo", torch.log(q) + torch.tensor([[5.0, -5.0]]),
                                      torch.tensor([-1.0]), mask, old=torch.log(q))
    assert torch.allclose(loss, torch.tensor([[10.0, 0.723607]], dtype=torch.float64), atol=1e-6)
    assert grad.abs().sum() == 0
    assert metrics["policy/clipfrac_dual_tokens"].as_tensor().tolist() == [1.0, 2.0]


def test_gmpo_hand_values():
    # Row 0 A = +1, d = [0.6, -0.2]: log clip 0.4 above -> [0.4, -0.2], mean 0.1, J = e^0.1.
    # Row 1 A = -1, d = [-0.6, 0.2]: clip below at -0.4 -> [-0.4, 0.2], mean -0.1, J = -e^-0.1.
    # Gradient (seq-mean-token-mean over 2 responses): clipped tokens 0, others -A s / (2 * 2).
    log_ratio = torch.tensor([[0.6, -0.2], [-0.6, 0.2]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, num, den, grad, metrics = _loss("gmpo", log_ratio, torch.tensor([1.0, -1.0]), mask)
    e1, em1 = math.exp(0.1), math.exp(-0.1)
    assert torch.allclose(loss, torch.tensor([[-e1, -e1], [em1, em1]]), atol=1e-6)
    assert (num / den).item() == pytest.approx((-e1 + em1) / 2, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[0.0, -e1 / 4], [0.0, em1 / 4]]), atol=1e-6)
    assert metrics["policy/clipfrac_high_tokens"].as_tensor().tolist() == [1.0, 4.0]
    assert metrics["policy/clipfrac_low_tokens"].as_tensor().tolist() == [1.0, 4.0]
    assert metrics["policy/zero_grad_frac_tokens"].as_tensor().tolist() == [2.0, 4.0]


def test_sapo_hand_values():
    # tau_pos = 1, token ratio r = 1 + ln 3 (A = +1): g = 2 tanh(ln3 / 2) = 2 * 0.5 = 1, psi = 2
    # (the paper's f = 4 sigmoid(ln 3) = 3, minus the constant 2/tau - 1 = 1). Gate weight
    # 4 * 3/4 * 1/4 = 3/4; d loss / d logprob = -A * 3/4 * r.
    # tau_neg = 2, r = 1 - ln(3)/2 (A = -1): g = tanh(-ln3 / 2) = -0.5, psi = -(1 - 0.5) = -0.5,
    # loss 0.5; weight 3/4; d loss / d logprob = +3/4 * r.
    r_pos, r_neg = 1 + LN3, 1 - LN3 / 2
    log_ratio = torch.log(torch.tensor([[r_pos], [r_neg]], dtype=torch.float64))
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss, _, _, grad, metrics = _loss("sapo", log_ratio, torch.tensor([1.0, -1.0]), mask,
                                      tau_pos=1.0, tau_neg=2.0)
    assert torch.allclose(loss, torch.tensor([[-2.0], [0.5]], dtype=torch.float64), atol=1e-12)
    expected = torch.tensor([[-0.75 * r_pos], [0.75 * r_neg]], dtype=torch.float64) / 2
    assert torch.allclose(grad, expected, atol=1e-12)
    assert _frac(metrics["policy/gate_weight"]) == pytest.approx(0.75, abs=1e-6)


def test_soft_seq_po_hand_values():
    # tau 1, sigmoid gate g(d) = 2 tanh(d / 2): g(ln 3) = 1, g(0) = 0 -> mean 0.5, w = e^0.5.
    # A = +1: per-token loss -e^0.5; gradient -A w g'(d_t) / |y| (/1 response):
    # g'(ln 3) = 3/4, g'(0) = 1 -> [-e^0.5 * 3/8, -e^0.5 / 2]. Gate weight mean 7/8.
    log_ratio = torch.tensor([[LN3, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _, _, grad, metrics = _loss("soft_seq_po", log_ratio, torch.tensor([1.0]), mask)
    w = math.exp(0.5)
    assert torch.allclose(loss, torch.full((1, 2), -w, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(grad, torch.tensor([[-w * 3 / 8, -w / 2]], dtype=torch.float64),
                          atol=1e-12)
    assert _frac(metrics["policy/gate_weight"]) == pytest.approx(7 / 8, abs=1e-6)
    # arctan gate: g(d) = atan(d); d = [1, -1] -> mean 0 -> w = 1; g'(+-1) = 1/2.
    loss, _, _, grad, _ = _loss("soft_seq_po", torch.tensor([[1.0, -1.0]], dtype=torch.float64),
                                torch.tensor([2.0]), mask, gate="arctan")
    assert torch.allclose(loss, torch.full((1, 2), -2.0, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(grad, torch.full((1, 2), -0.5, dtype=torch.float64), atol=1e-12)


def test_cispo_hand_values():
    # old prob 0.5 everywhere; eps_low_is = eps_high_is = 0.2 -> weight clip [0.8, 1.2].
    # Row 0 (A = 1): p = 0.75 -> r = 1.5 -> weight 1.2 (clipped high), loss -1.2 ln 0.75;
    #                p = 0.45 -> r = 0.9 -> weight 0.9, loss -0.9 ln 0.45.
    # Row 1 (A = -2): p = 0.25 -> r = 0.5 -> weight 0.8 (clipped low), loss +1.6 ln 0.25.
    # Gradients (token mean over 3): -weight * A / 3 = [-0.4, -0.3 | 0.5333], never zeroed.
    probs = torch.tensor([[0.75, 0.45], [0.25, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    loss, num, den, grad, metrics = _loss(
        "cispo", torch.log(probs), torch.tensor([1.0, -2.0]), mask,
        old=torch.full((2, 2), math.log(0.5), dtype=torch.float64), eps_low_is=0.2,
        eps_high_is=0.2)
    expected = torch.tensor([[-1.2 * math.log(0.75), -0.9 * math.log(0.45)],
                             [1.6 * math.log(0.25), 0.0]], dtype=torch.float64)
    assert torch.allclose(loss, expected, atol=1e-12)
    assert torch.allclose(grad, torch.tensor([[-0.4, -0.3], [1.6 / 3, 0.0]],
                                             dtype=torch.float64), atol=1e-12)
    assert metrics["policy/clipfrac_high_tokens"].as_tensor().tolist() == [1.0, 3.0]
    assert metrics["policy/clipfrac_low_tokens"].as_tensor().tolist() == [1.0, 3.0]
    assert metrics["policy/zero_grad_frac_tokens"].as_tensor().tolist() == [0.0, 3.0]


# Covariance case: 4 one-token responses, logprobs [-1, -2, -3, -5] (mean -2.75), A [2, 1, -1, -2]
# (mean 0): Cov = [1.75*2, 0.75*1, -0.25*-1, -2.25*-2] = [3.5, 0.75, 0.25, 4.5].
# Token log-ratios d = [0.1, -0.1, 0.05, -0.05]: every ratio within [0.8, 1.2], nothing clipped.
COV_LOGPROBS = torch.tensor([[-1.0], [-2.0], [-3.0], [-5.0]], dtype=torch.float64)
COV_D = torch.tensor([[0.1], [-0.1], [0.05], [-0.05]], dtype=torch.float64)
COV_ADV = torch.tensor([2.0, 1.0, -1.0, -2.0])
COV_MASK = torch.ones(4, 1, dtype=torch.bool)


def test_covariance_selection_hand_values():
    from nemo_sspo.algorithms.losses import select_high_covariance_tokens

    sel, cov = select_high_covariance_tokens(COV_LOGPROBS, COV_ADV, COV_MASK, 0.5)
    assert torch.allclose(cov[:, 0], torch.tensor([3.5, 0.75, 0.25, 4.5], dtype=torch.float64))
    assert sel[:, 0].tolist() == [True, False, False, True]  # floor(0.5 * 4) = 2 highest
    sel, _ = select_high_covariance_tokens(COV_LOGPROBS, COV_ADV, COV_MASK, 0.25)
    assert sel[:, 0].tolist() == [False, False, False, True]
    sel, _ = select_high_covariance_tokens(COV_LOGPROBS, COV_ADV, COV_MASK, 0.5, cov_min=1.0,
                                           cov_max=4.0)
    assert sel[:, 0].tolist() == [True, False, False, False]  # only 3.5 in the band
    sel, _ = select_high_covariance_tokens(COV_LOGPROBS, COV_ADV, COV_MASK, 0.2)
    assert sel[:, 0].tolist() == [False, False, False, True]  # max(1, floor(0.2 * 4)) = 1: 4.5
    sel, _ = select_high_covariance_tokens(COV_LOGPROBS, COV_ADV, COV_MASK, 0.0)
    assert not sel.any()  # fraction 0 selects nothing


def test_clip_cov_zeroes_selected_tokens():
    # Band (1, 5), fraction 0.5: quota 2, eligible tokens 0 (3.5) and 3 (4.5), both drawn. Their
    # loss is 0 (value and gradient, as the official loss multiplies it by 0); the others keep
    # -r A with gradient -r A / 4 (token mean over 4 tokens).
    loss, _, _, grad, metrics = _loss("clip_cov", COV_LOGPROBS, COV_ADV, COV_MASK,
                                      old=COV_LOGPROBS - COV_D, select_fraction=0.5)
    r = torch.exp(COV_D)[:, 0]
    adv = COV_ADV.double()
    assert torch.allclose(loss[:, 0], torch.tensor([0.0, -r[1], r[2], 0.0],
                                                   dtype=torch.float64), atol=1e-12)
    expected = torch.tensor([0.0, -r[1] * 1.0 / 4, r[2] / 4, 0.0], dtype=torch.float64)
    assert torch.allclose(grad[:, 0], expected, atol=1e-12)
    assert metrics["policy/cov_selected_frac"].as_tensor().tolist() == [2.0, 4.0]
    assert metrics["policy/zero_grad_frac_tokens"].as_tensor().tolist() == [2.0, 4.0]
    assert adv.tolist() == [2.0, 1.0, -1.0, -2.0]


def test_clip_cov_defaults_match_the_official_recipe():
    # PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/7b_clip_cov.sh: clip 1/1, ratio 2e-4, band
    # (1, 5), token-mean.
    cfg = get_policy_loss("clip_cov").config_cls()
    assert (cfg.eps_low, cfg.eps_high, cfg.select_fraction) == (1.0, 1.0, 2e-4)
    assert (cfg.cov_min, cfg.cov_max, cfg.aggregation) == (1.0, 5.0, "token-mean")


def test_clip_cov_skips_clipped_tokens_and_band_edges():
    # Five one-token responses, logprobs [-1, -2, -3, -4, -5] (mean -3), A [2, 1, 0, -1, -2]
    # (mean 0): Cov = [(2)(2), (1)(1), 0, (-1)(-1), (-2)(-2)] = [4, 1, 0, 1, 4].
    # Band (1, 5) strict: tokens 1 and 3 (Cov == 1, the edge) are out; tokens 0 and 4 have Cov 4.
    # Token 0 (A = 2 > 0) has ratio e^1 = 2.718 > 1 + eps_high = 2: the clip cut it, so it is no
    # candidate either. Only token 4 is left (ratio 1): quota max(1, floor(0.4 * 5)) = 2, 1 drawn.
    lp = torch.tensor([[-1.0], [-2.0], [-3.0], [-4.0], [-5.0]], dtype=torch.float64)
    d = torch.tensor([[1.0], [0.0], [0.0], [0.0], [0.0]], dtype=torch.float64)
    adv = torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0])
    mask = torch.ones(5, 1, dtype=torch.bool)
    loss, _, _, grad, metrics = _loss("clip_cov", lp, adv, mask, old=lp - d, select_fraction=0.4)
    assert metrics["policy/cov_selected_frac"].as_tensor().tolist() == [1.0, 5.0]
    # Token 0 keeps the clipped value -2 * 2 = -4 (no gradient); token 4 is zeroed.
    assert torch.allclose(loss[:, 0], torch.tensor([-4.0, -1.0, 0.0, 1.0, 0.0],
                                                   dtype=torch.float64), atol=1e-12)
    # Gradients -r A / 5 for the free tokens 1-3: [-0.2, 0, 0.2].
    assert torch.allclose(grad[:, 0], torch.tensor([0.0, -0.2, 0.0, 0.2, 0.0],
                                                   dtype=torch.float64), atol=1e-12)
    # The edge value itself is excluded: the band (0.5, 1) admits nothing (Cov == 1 is not < 1).
    _, _, _, _, m = _loss("clip_cov", lp, adv, mask, old=lp - d, select_fraction=0.4,
                          cov_min=0.5, cov_max=1.0)
    assert m["policy/cov_selected_frac"].as_tensor().tolist() == [0.0, 5.0]


def test_clip_cov_random_draw_is_seeded_and_hand_derived():
    from nemo_sspo.algorithms.losses import select_random_covariance_tokens

    # Four one-token responses, all Cov = (lp - mean)(A - mean) in (0, 10): lp [-1, -2, -3, -4]
    # (mean -2.5), A [1, 0.5, -0.5, -1] (mean 0): Cov = [1.5, 0.25, 0.25, 1.5]; all eligible in
    # (0, 10). Quota max(1, floor(0.5 * 4)) = 2. Keys: torch.rand(4, 1) in float64 from a CPU
    # generator seeded 0, row-major: 0.9701, 0.7078, 0.4594, 0.9207 (asserted below) -> the two
    # highest keys are positions 0 and 3.
    lp = torch.tensor([[-1.0], [-2.0], [-3.0], [-4.0]])
    adv = torch.tensor([1.0, 0.5, -0.5, -1.0])
    mask = torch.ones(4, 1, dtype=torch.bool)
    keys = torch.rand(4, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert [round(k, 4) for k in keys[:, 0].tolist()] == [0.9701, 0.7078, 0.4594, 0.9207]

    def draw(seed):
        return select_random_covariance_tokens(lp, adv, mask, 0.5, cov_min=0.0, cov_max=10.0,
                                               exclude=torch.zeros_like(mask), seed=seed)

    selected, cov = draw(0)
    assert torch.allclose(cov[:, 0], torch.tensor([1.5, 0.25, 0.25, 1.5]))
    assert selected[:, 0].tolist() == [True, False, False, True]
    assert torch.equal(draw(0)[0], selected)  # reproducible
    # Another seed may pick other tokens, always 2 of the 4 eligible.
    assert all(int(draw(s)[0].sum()) == 2 for s in range(5))
    assert len({tuple(draw(s)[0][:, 0].tolist()) for s in range(20)}) > 1


def test_kl_cov_penalises_selected_tokens():
    # Fraction 0.5, no band: tokens 3 (4.5) and 0 (3.5). Loss -r A + beta |d| there (beta 2);
    # gradient -r A + beta sign(d), all over 4 tokens.
    loss, _, _, grad, metrics = _loss("kl_cov", COV_LOGPROBS, COV_ADV, COV_MASK,
                                      old=COV_LOGPROBS - COV_D, select_fraction=0.5,
                                      cov_kl_coef=2.0)
    r, adv = torch.exp(COV_D)[:, 0], COV_ADV.double()
    penalty = torch.tensor([2 * 0.1, 0.0, 0.0, 2 * 0.05], dtype=torch.float64)
    assert torch.allclose(loss[:, 0], -r * adv + penalty, atol=1e-12)
    sign = torch.tensor([2.0, 0.0, 0.0, -2.0], dtype=torch.float64)
    assert torch.allclose(grad[:, 0], (-r * adv + sign) / 4, atol=1e-12)
    assert metrics["policy/cov_selected_frac"].as_tensor().tolist() == [2.0, 4.0]


# ----------------------------------------------------------------------------- float64 references

def _rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


def _aggregate_ref(per_row, mode, l_max):
    """per_row: {row: [objective per token]} of non-empty rows -> scalar J (to maximise)."""
    rows = list(per_row.values())
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    assert mode == "constant-denominator"
    return sum(sum(r) / l_max for r in rows) / len(rows)


def _clip_term(s, a, low, high, dual=None):
    term = torch.minimum(s * a, torch.clamp(s, low, high) * a)
    if dual is not None and a < 0:
        term = torch.maximum(term, dual * a)
    return term


def _ref_token_clip(lp, old, adv, mask, seg, cfg):
    return {i: [_clip_term(torch.exp(lp[i, t] - old[i, t]), adv[i], 1 - cfg.eps_low,
                           1 + cfg.eps_high, cfg.dual_clip_c) for t in ts]
            for i, ts in enumerate(_rows(mask)) if ts}


def _ref_segment_clip(lp, old, adv, mask, seg, cfg, whole_response=False):
    """SSPO eq. 9 segments (by id) with fixed bounds; one segment per row for GSPO."""
    out = {}
    for i, ts in enumerate(_rows(mask)):
        if not ts:
            continue
        groups = {}
        for t in ts:
            groups.setdefault(0 if whole_response else int(seg[i, t]), []).append(t)
        term_of = {}
        for members in groups.values():
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in members) / len(members))
            for t in members:
                term_of[t] = _clip_term(s, adv[i], 1 - cfg.eps_low, 1 + cfg.eps_high)
        out[i] = [term_of[t] for t in ts]
    return out


def _ref_response_clip(lp, old, adv, mask, seg, cfg):
    """GSPO: one segment per row (the loss's fixed unit "response"); the ids are not read."""
    return _ref_segment_clip(lp, old, adv, mask, seg, cfg, whole_response=True)


def _ref_gspo_token(lp, old, adv, mask, seg, cfg):
    # s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] (GSPO sec. 4.3), clipped like GSPO.
    out = {}
    for i, ts in enumerate(_rows(mask)):
        if ts:
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in ts) / len(ts)).detach()
            out[i] = [_clip_term(s * torch.exp(lp[i, t] - lp[i, t].detach()), adv[i],
                                 1 - cfg.eps_low, 1 + cfg.eps_high) for t in ts]
    return out


def _ref_dcpo(lp, old, adv, mask, seg, cfg):
    out = {}
    for i, ts in enumerate(_rows(mask)):
        terms = []
        for t in ts:
            q = math.exp(old[i, t].item())
            # Roots of r^2 - r - eps_high/q = 0 and r^2 - r + eps_low/q = 0 nearest 1.
            high = min((1 + math.sqrt(1 + 4 * cfg.eps_high / q)) / 2, cfg.ratio_max)
            low = (1 + math.sqrt(max(1 - 4 * cfg.eps_low / q, 0.0))) / 2
            terms.append(_clip_term(torch.exp(lp[i, t] - old[i, t]), adv[i], low, high,
                                    cfg.dual_clip_c))
        if ts:
            out[i] = terms
    return out


def _geometric_means(mask, factor):
    """{row: G_i} of the rows with a token: G_i = prod_t factor(i, t) ** (1 / |y_i|) over row i's tokens."""
    out = {}
    for i, ts in enumerate(_rows(mask)):
        if ts:
            product = 1.0
            for t in ts:
                product = product * factor(i, t) ** (1 / len(ts))
            out[i] = product
    return out


def _ref_gmpo(lp, old, adv, mask, seg, cfg):
    # J_i = sgn(A) prod_t |min(rho A, clip(rho, e^-eps_low, e^eps_high) A)|^(1/|y_i|) (GMPO).
    def factor(i, t):
        rho = torch.exp(lp[i, t] - old[i, t])
        clipped = torch.clamp(rho, math.exp(-cfg.log_clip_low), math.exp(cfg.log_clip_high))
        return torch.abs(torch.minimum(rho * adv[i], clipped * adv[i]))

    return {i: [torch.sign(adv[i]) * g] * int(mask[i].sum()) for i, g in _geometric_means(mask, factor).items()}


def _ref_sapo(lp, old, adv, mask, seg, cfg):
    # Paper: f(r) A with f(r) = (4/tau) sigmoid(tau (r - 1)); ours adds the constant -(2/tau - 1) A.
    out = {}
    for i, ts in enumerate(_rows(mask)):
        tau = cfg.tau_pos if adv[i] > 0 else cfg.tau_neg
        terms = []
        for t in ts:
            r = torch.exp(lp[i, t] - old[i, t])
            terms.append(adv[i] * (4 / tau) * torch.sigmoid(tau * (r - 1))
                         - (2 / tau - 1) * adv[i])
        if ts:
            out[i] = terms
    return out


def _ref_soft_seq_po(lp, old, adv, mask, seg, cfg):
    # Our plain definition: J_i = A_i (prod_t exp(g(d_t)))^(1/|y_i|), g(x) = (4/tau)(sigmoid(tau x) - 1/2).
    def factor(i, t):
        tau = cfg.tau_pos if adv[i] > 0 else cfg.tau_neg
        return torch.exp((4 / tau) * (torch.sigmoid(tau * (lp[i, t] - old[i, t])) - 0.5))

    return {i: [adv[i] * g] * int(mask[i].sum()) for i, g in _geometric_means(mask, factor).items()}


def _ref_cispo(lp, old, adv, mask, seg, cfg):
    out = {}
    for i, ts in enumerate(_rows(mask)):
        if ts:
            out[i] = [torch.clamp(torch.exp(lp[i, t] - old[i, t]), 1 - cfg.eps_low_is,
                                  1 + cfg.eps_high_is).detach() * adv[i] * lp[i, t] for t in ts]
    return out


def _ref_selected(lp, adv, mask, fraction, low, high):
    """Positions of the floor(fraction N) highest Cov_t within [low, high] (Python sort)."""
    cells = [(i, t) for i, ts in enumerate(_rows(mask)) for t in ts]
    lp = lp.detach()  # the selection is a constant of the update: plain floats, no graph
    mean_lp = sum(lp[c].item() for c in cells) / len(cells)
    mean_a = sum(adv[i].item() for i, _ in cells) / len(cells)
    cov = {c: (lp[c].item() - mean_lp) * (adv[c[0]].item() - mean_a) for c in cells}
    eligible = sorted((c for c in cells if low <= cov[c] <= high), key=lambda c: -cov[c])
    return set(eligible[: math.floor(fraction * len(cells))])


def _ref_clip_cov(lp, old, adv, mask, seg, cfg):
    """Official rule (PRIME-RL core_algos.py): candidates are unclipped tokens with
    cov_min < Cov < cov_max; max(1, floor(r N)) of them are drawn; their term is multiplied by 0.
    The draw: the highest of per-position keys torch.rand([B, T]) seeded with selection_seed."""
    cells = [(i, t) for i, ts in enumerate(_rows(mask)) for t in ts]
    lp_value = lp.detach()  # selection is a constant of the update: plain floats, no graph
    mean_lp = sum(lp_value[c].item() for c in cells) / len(cells)
    mean_a = sum(adv[i].item() for i, _ in cells) / len(cells)
    keys = torch.rand(mask.shape, generator=torch.Generator().manual_seed(cfg.selection_seed),
                      dtype=torch.float64)
    base = _ref_token_clip(lp, old, adv, mask, seg, cfg)
    candidates = []
    for i, t in cells:
        ratio = math.exp((lp_value[i, t] - old[i, t]).item())
        clipped = ((adv[i] > 0 and ratio > 1 + cfg.eps_high)
                   or (adv[i] < 0 and ratio < 1 - cfg.eps_low))
        cov = (lp_value[i, t].item() - mean_lp) * (adv[i].item() - mean_a)
        if not clipped and cfg.cov_min < cov < cfg.cov_max:
            candidates.append((i, t))
    candidates.sort(key=lambda c: -keys[c].item())
    chosen = set(candidates[: max(1, math.floor(cfg.select_fraction * len(cells)))])
    return {i: [v * 0.0 if (i, t) in chosen else v for t, v in zip(_rows(mask)[i], terms)]
            for i, terms in base.items()}


def _ref_kl_cov(lp, old, adv, mask, seg, cfg):
    chosen = _ref_selected(lp, adv, mask, cfg.select_fraction, -math.inf, math.inf)
    out = {}
    for i, ts in enumerate(_rows(mask)):
        if ts:
            out[i] = [torch.exp(lp[i, t] - old[i, t]) * adv[i]
                      - (cfg.cov_kl_coef * torch.abs(lp[i, t] - old[i, t]) if (i, t) in chosen
                         else 0.0) for t in ts]
    return out


REFERENCE_CASES = [
    ("grpo", dict(eps_low=0.1, eps_high=0.15, dual_clip_c=1.5), _ref_token_clip),
    ("dr_grpo", dict(), _ref_token_clip),
    ("dapo", dict(), _ref_token_clip),
    ("gspo", dict(eps_low=0.05, eps_high=0.08), _ref_response_clip),
    ("gspo_token", dict(eps_low=0.05, eps_high=0.08), _ref_gspo_token),
    ("lpo", dict(eps_low=0.1, eps_high=0.1), _ref_segment_clip),
    ("dcpo", dict(), _ref_dcpo),
    ("gmpo", dict(log_clip_low=0.3, log_clip_high=0.3), _ref_gmpo),
    ("sapo", dict(tau_pos=1.0, tau_neg=1.05), _ref_sapo),
    ("soft_seq_po", dict(tau_pos=1.5, tau_neg=0.7), _ref_soft_seq_po),
    ("cispo", dict(eps_low_is=0.2, eps_high_is=0.3), _ref_cispo),
    ("clip_cov", dict(select_fraction=0.2, cov_min=0.05, cov_max=0.6), _ref_clip_cov),
    ("kl_cov", dict(select_fraction=0.15, cov_kl_coef=0.5), _ref_kl_cov),
]


def _random_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, width = 5, 9
    old = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 3
    logprobs = old + 0.5 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor([9, 6, 1, 0, 4]).unsqueeze(1)
    closes = torch.rand(rows, width, generator=gen) < 0.35
    segments = torch.where(mask, torch.cumsum(closes.long(), 1) - closes.long(), -1)
    adv = torch.tensor([-1.3, 0.7, 0.9, 0.5, -0.4], dtype=torch.float64)
    entropy = torch.rand(rows, width, generator=gen, dtype=torch.float64)
    return logprobs, old, adv, mask, segments, entropy


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize(("name", "params", "reference"), REFERENCE_CASES,
                         ids=[c[0] for c in REFERENCE_CASES])
def test_matches_float64_reference(name, params, reference, seed):
    logprobs, old, adv, mask, segments, entropy = _random_batch(seed)
    _, num, den, grad, metrics = _loss(name, logprobs, adv, mask, old=old, segments=segments,
                                       old_entropy=entropy, **params)
    config = get_policy_loss(name).config_cls(**params)
    lp = logprobs.clone().requires_grad_(True)
    objective = _aggregate_ref(reference(lp, old, adv, mask, segments, config), config.aggregation,
                               mask.shape[1])
    (ref_grad,) = torch.autograd.grad(-objective, lp)
    assert (num / den).item() == pytest.approx(-objective.item(), abs=1e-12)
    assert torch.allclose(grad, ref_grad, atol=1e-12, rtol=0)
    # Not degenerate: clip losses clip some tokens but not all; cov losses select some.
    case = loss_case(name)
    if case.clips_random_batch:
        assert 0 < _frac(metrics["policy/clipfrac_tokens"]) < 1
    if case.selects_random_batch:
        assert metrics["policy/cov_selected_frac"].total >= 1


# ----------------------------------------------------------------------------- identities

def _same(a, b, atol=1e-12):
    for x, y in zip(a[:4], b[:4]):
        assert torch.allclose(torch.as_tensor(x, dtype=torch.float64),
                              torch.as_tensor(y, dtype=torch.float64), atol=atol, rtol=0)


def test_gspo_token_equals_gspo_with_response_advantages():
    logprobs, old, adv, mask, segments, entropy = _random_batch(1)
    args = (logprobs, adv, mask)
    kw = dict(old=old, segments=segments, old_entropy=entropy, eps_low=0.02, eps_high=0.03)
    _same(_loss("gspo_token", *args, **kw), _loss("gspo", *args, **kw))


def test_gmpo_without_clip_equals_unclipped_gspo():
    # Huge log clip and huge eps: both reduce to psi = s A with s the sequence ratio.
    logprobs, old, adv, mask, segments, entropy = _random_batch(2)
    kw = dict(old=old, segments=segments, old_entropy=entropy)
    _same(_loss("gmpo", logprobs, adv, mask, log_clip_low=50.0, log_clip_high=50.0, **kw),
          _loss("gspo", logprobs, adv, mask, eps_low=1.0, eps_high=1e9, **kw))


def test_soft_seq_po_small_temperature_tends_to_unclipped_gspo():
    # g(x) = (2/tau) tanh(tau x / 2) = x - tau^2 x^3 / 12 + ...: at tau = 1e-4 and |x| < 3 the
    # gated log-ratio differs by < 1e-7, so values and gradients agree to ~1e-6.
    logprobs, old, adv, mask, segments, entropy = _random_batch(2)
    kw = dict(old=old, segments=segments, old_entropy=entropy)
    _same(_loss("soft_seq_po", logprobs, adv, mask, tau_pos=1e-4, tau_neg=1e-4, **kw),
          _loss("gspo", logprobs, adv, mask, eps_low=1.0, eps_high=1e9, **kw), atol=1e-6)


def test_lpo_is_sspo_fixed_clip_under_token_mean():
    logprobs, old, adv, mask, segments, entropy = _random_batch(4)
    kw = dict(old=old, segments=segments, old_entropy=entropy, eps_low=0.1, eps_high=0.12)
    _same(_loss("lpo", logprobs, adv, mask, **kw),
          _loss("sspo_fixed_clip", logprobs, adv, mask, aggregation="token-mean", **kw))


def test_grpo_variants_share_per_token_loss():
    # dr_grpo and dapo differ from grpo only in aggregation (and dapo's eps_high).
    logprobs, old, adv, mask, segments, entropy = _random_batch(5)
    kw = dict(old=old, segments=segments, old_entropy=entropy)
    grpo = _loss("grpo", logprobs, adv, mask, **kw)[0]
    assert torch.equal(_loss("dr_grpo", logprobs, adv, mask, **kw)[0], grpo)
    assert torch.equal(_loss("dapo", logprobs, adv, mask, eps_high=0.2, **kw)[0], grpo)


def test_clip_cov_with_nothing_selected_is_grpo():
    # GRPO's clip 0.2/0.2 set on clip_cov (its default is the recipe's 1/1).
    logprobs, old, adv, mask, segments, entropy = _random_batch(6)
    kw = dict(old=old, segments=segments, old_entropy=entropy, aggregation="token-mean")
    _same(_loss("clip_cov", logprobs, adv, mask, select_fraction=0.0, eps_low=0.2, eps_high=0.2,
                **kw),
          _loss("grpo", logprobs, adv, mask, **kw))


def test_sspo_segmentation_response_equals_gspo_bounds_aside():
    # sspo_fixed_clip with segmentation "response" ignores the passed ids: it is GSPO's ratio.
    logprobs, old, adv, mask, segments, entropy = _random_batch(7)
    kw = dict(old=old, segments=segments, old_entropy=entropy, eps_low=0.05, eps_high=0.05)
    _same(_loss("sspo_fixed_clip", logprobs, adv, mask, segmentation="response", **kw),
          _loss("gspo", logprobs, adv, mask, **kw))


# ----------------------------------------------------------------------------- pitfalls

def test_every_registered_loss_has_a_row_of_hand_values():
    missing = [name for name in policy_loss_names() if name not in LOSS_CASES]
    assert not missing, f"add {missing} to tests/unit/loss_cases.py LOSS_CASES"
    assert sorted(LOSS_CASES) == policy_loss_names()  # no row for a loss that no longer exists


@pytest.mark.parametrize("name", policy_loss_names())
def test_ratio_one_gives_the_policy_gradient(name):
    # docs/pitfalls.md#p1: on-policy (ratio 1) every token's gradient is -A_i times the token's
    # aggregation weight, whatever the loss; the per-token value is the row's on_policy_value
    # (-A for ratio losses). The p1 batch: lengths [2, 4], A [+1, -1], log pi -1 everywhere.
    case = loss_case(name)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    logprobs, adv = torch.full((2, 4), -1.0, dtype=torch.float64), torch.tensor([1.0, -1.0])
    loss, num, den, grad, _ = _loss(name, logprobs, adv, mask, old=logprobs.clone(), l_max=4)
    expected = torch.where(mask, case.on_policy_value(adv.double(), logprobs), 0.0)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    mode = get_policy_loss(name).config_cls().aggregation
    value, count = hand_aggregate(expected, mask, mode, 4)
    assert (num / den).item() == pytest.approx(value, abs=1e-12) and den.item() == count
    weights = token_weights(mask, mode, 4)
    torch.testing.assert_close(grad, -adv.double()[:, None] * weights, rtol=0, atol=1e-12)


def _p3_expected(name, advantage, mode):
    """(per-token loss [2, 3], d(num/den)/d logprobs [2, 3]) of the P3 case, float64, from the
    loss's row (tests/unit/loss_cases.py) and the aggregation's token weights (by hand)."""
    case = loss_case(name)
    value = {0.0: 0.0, 1.0: case.p3_plus, -1.0: case.p3_minus}[advantage]
    loss = torch.full((2, 3), value, dtype=torch.float64)
    grad = torch.full((2, 3), case.p3_grad_per_advantage * advantage, dtype=torch.float64)
    extra_loss, extra_grad = case.p3_first_token
    loss[0, 0] += extra_loss
    grad[0, 0] += extra_grad
    return loss, grad * token_weights(torch.ones(2, 3, dtype=torch.bool), mode, 3)


def _p3_run(name, advantage):
    """``_loss`` at log-ratio 100 on every token (old -120), with the hand-worked (loss, grad) and the
    loss's aggregation mode."""
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = torch.full((2, 3), -120.0)
    result = _loss(name, old + 100.0, torch.full((2,), advantage), mask, old=old,
                   segments=torch.zeros(2, 3, dtype=torch.long), old_entropy=torch.ones(2, 3))
    mode = get_policy_loss(name).config_cls().aggregation
    return result, *_p3_expected(name, advantage, mode), mode


@pytest.mark.parametrize("name", policy_loss_names())
@pytest.mark.parametrize("advantage", [0.0, 1.0, -1.0])
def test_p3_huge_log_ratio_loss_values(name, advantage):
    (loss, num, den, _, _), expected, _, mode = _p3_run(name, advantage)
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = torch.full((2, 3), -120.0)
    # rtol 1e-7: float32 holds e^20 as 485165184 (2.4e-8 relative) and the kl_cov penalty of 100
    # is 2e-7 relative, so the tolerance (48.5 at e^20) still sees it.
    torch.testing.assert_close(loss.double(), expected, rtol=1e-7, atol=1e-6)
    value, _ = hand_aggregate(expected, mask, mode, 3)
    assert (num / den).item() == pytest.approx(value, rel=1e-7, abs=1e-6)
    inputs = LossInputs(logprobs=old + 100.0, old_logprobs=old, advantages=torch.full((2,), advantage),
                        response_mask=mask, segment_ids=torch.zeros(2, 3, dtype=torch.long),
                        old_entropy=torch.ones(2, 3))
    _, metrics = compute_policy_loss(name, inputs, max_response_length=3)
    # Raw ratios are reported through the same clamp: exp(min(100, 20)); k1 = -d = -100.
    assert metrics["policy/ratio_token_max"] == pytest.approx(E20, rel=1e-7)
    assert metrics["policy/approx_kl_k1"] == -100.0


@pytest.mark.parametrize("name", policy_loss_names())
@pytest.mark.parametrize("advantage", [0.0, 1.0, -1.0])
def test_p3_huge_log_ratio_gradients(name, advantage):
    (_, _, _, grad, _), _, expected, _ = _p3_run(name, advantage)
    torch.testing.assert_close(grad.double(), expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("name", policy_loss_names())
def test_p12_empty_response_and_nan_padding(name):
    # docs/pitfalls.md#p12. Row 1 is empty and all padding is NaN: loss and gradient exactly 0
    # there (a NaN would fail == 0), and row 0 as if it were alone.
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    nan = math.nan
    logprobs = torch.tensor([[-1.0, -2.0, nan], [nan, nan, nan]])
    old = torch.tensor([[-1.1, -1.9, nan], [nan, nan, nan]])
    entropy = torch.tensor([[0.5, 0.5, nan], [nan, nan, nan]])
    loss, num, den, grad, _ = _loss(name, logprobs, torch.tensor([1.0, 3.0]), mask, old=old,
                                    segments=torch.where(mask, 0, -1), old_entropy=entropy)
    assert loss[1].abs().sum() == 0 and loss[0, 2] == 0
    assert grad[1].abs().sum() == 0 and grad[0, 2] == 0
    # The denominator counts row 0 only (2 tokens or 1 response, per the mode), never the empty row.
    assert den.item() == hand_aggregate(torch.ones(2, 3), mask, get_policy_loss(name).config_cls().aggregation,
                                        3)[1]
    # Second computation: row 0 alone, without the empty row or the padding column (same L_max 3).
    # Padding must change nothing: the same per-token loss, numerator, gradient and metrics.
    clean = dict(old=old[:1, :2], segments=torch.zeros(1, 2, dtype=torch.long),
                 old_entropy=entropy[:1, :2], l_max=3)
    clean_loss, clean_num, clean_den, clean_grad, _ = _loss(name, logprobs[:1, :2],
                                                            torch.tensor([1.0]), mask[:1, :2], **clean)
    torch.testing.assert_close(loss[0, :2], clean_loss[0], rtol=0, atol=0)
    torch.testing.assert_close(grad[0, :2], clean_grad[0], rtol=0, atol=0)
    assert (num.item(), den.item()) == (clean_num.item(), clean_den.item())
    padded_metrics = compute_policy_loss(name, LossInputs(
        logprobs=logprobs, old_logprobs=old, advantages=torch.tensor([1.0, 3.0]), response_mask=mask,
        segment_ids=torch.where(mask, 0, -1), old_entropy=entropy), max_response_length=3)[1]
    clean_metrics = compute_policy_loss(name, LossInputs(
        logprobs=logprobs[:1, :2], old_logprobs=old[:1, :2], advantages=torch.tensor([1.0]),
        response_mask=mask[:1, :2], segment_ids=torch.zeros(1, 2, dtype=torch.long),
        old_entropy=entropy[:1, :2]), max_response_length=3)[1]
    assert padded_metrics == pytest.approx(clean_metrics, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("name", policy_loss_names())
def test_fully_masked_batch(name):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, num, den, grad, metrics = _loss(name, torch.zeros(2, 3), torch.ones(2), mask,
                                          segments=torch.full((2, 3), -1))
    assert loss.abs().sum() == 0 and num.item() == 0.0 and den.item() == 0.0
    assert grad is None or grad.abs().sum() == 0
    assert all(v.as_tensor().tolist() == [0.0, 0.0] for v in metrics.values())


# ----------------------------------------------------------------------------- primary-source defaults

def test_lpo_defaults_follow_the_ling_report():
    # Ling 2.0 report (arXiv 2510.22115) section 4.2.2: eps = 0.03, pause-punctuation sentences,
    # 1 / sum |y_i| (token mean).
    cfg = get_policy_loss("lpo").config_cls()
    assert (cfg.eps_low, cfg.eps_high) == (0.03, 0.03)
    assert (cfg.segmentation, cfg.aggregation) == ("pause_punctuation", "token-mean")
    # One response (A = +1), sentences [t0 t1 | t2]: mean log-ratio of sentence 0 is
    # (ln 1.1 + ln 1.0) / 2 -> ratio sqrt(1.1) = 1.048809 > 1.03: clipped to 1.03, no gradient;
    # sentence 1 ratio 1.02 inside: objective 1.02. Token mean over 3 tokens:
    # J = (2 * 1.03 + 1.02) / 3 = 3.08 / 3 = 1.026667; d(-J)/d lp_2 = -1.02 / 3 = -0.34.
    log_ratio = torch.log(torch.tensor([[1.1, 1.0, 1.02]], dtype=torch.float64))
    mask = torch.ones(1, 3, dtype=torch.bool)
    _, num, den, grad, _ = _loss("lpo", log_ratio, torch.tensor([1.0]), mask,
                                 segments=torch.tensor([[0, 0, 1]]))
    assert (num / den).item() == pytest.approx(-3.08 / 3, abs=1e-12)
    assert torch.allclose(grad, torch.tensor([[0.0, 0.0, -0.34]], dtype=torch.float64),
                          atol=1e-12)


def test_sppo_dual_clip_three_for_negative_advantage():
    # Official SPPO runs keep verl's actor defaults: clip 0.2, dual clip c = 3, token-mean.
    cfg = get_policy_loss("sppo").config_cls()
    assert (cfg.eps_low, cfg.eps_high, cfg.dual_clip_c) == (0.2, 0.2, 3.0)
    assert (cfg.segmentation, cfg.aggregation) == ("token", "token-mean")
    # A = -1, ratios [5, 2]: min(r A, clip(r, 0.8, 1.2) A) = [-5, -2]; dual clip max(., c A = -3)
    # -> [-3, -2]: losses [3, 2]. Token 0's gradient is cut; token 1's: -r A / 2 = 1.0.
    log_ratio = torch.log(torch.tensor([[5.0, 2.0]], dtype=torch.float64))
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _, _, grad, metrics = _loss("sppo", log_ratio, torch.tensor([-1.0]), mask)
    assert torch.allclose(loss, torch.tensor([[3.0, 2.0]], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(grad, torch.tensor([[0.0, 1.0]], dtype=torch.float64), atol=1e-12)
    assert metrics["policy/clipfrac_dual_tokens"].as_tensor().tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="dual_clip_c=1.0 must be > 1"):
        get_policy_loss("sppo").config_cls(dual_clip_c=1.0)


def test_cispo_weight_cap_is_five():
    # ScaleRL's epsilon_max = 5 (TRL's recommendation for CISPO): eps_high_is = 4.
    # pi_old = 0.1; pi = 0.7 -> r = 7, weight min(7, 5) = 5; pi = 0.3 -> r = 3 (the old cap 2
    # would have clipped it), weight 3. A = +1. Losses -w ln pi; gradients -w / 2 (token mean).
    cfg = get_policy_loss("cispo").config_cls()
    assert (cfg.eps_low_is, cfg.eps_high_is) == (1.0, 4.0)
    probs = torch.tensor([[0.7, 0.3]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _, _, grad, metrics = _loss("cispo", torch.log(probs), torch.tensor([1.0]), mask,
                                      old=torch.full((1, 2), math.log(0.1), dtype=torch.float64))
    expected = torch.tensor([[-5 * math.log(0.7), -3 * math.log(0.3)]], dtype=torch.float64)
    assert torch.allclose(loss, expected, atol=1e-12)
    assert torch.allclose(grad, torch.tensor([[-2.5, -1.5]], dtype=torch.float64), atol=1e-12)
    assert metrics["policy/clipfrac_high_tokens"].as_tensor().tolist() == [1.0, 2.0]


def test_kl_cov_and_gmpo_and_sapo_defaults_match_their_sources():
    # KL-Cov recipe (7b_kl_cov.sh): k_percent 0.2 % = 2e-3, ppo_kl_coef 1, token-mean.
    kl = get_policy_loss("kl_cov").config_cls()
    assert (kl.select_fraction, kl.cov_kl_coef, kl.aggregation) == (2e-3, 1.0, "token-mean")
    # verl examples/gmpo_trainer: clip_ratio_low = clip_ratio_high = 0.4 (log space).
    gmpo = get_policy_loss("gmpo").config_cls()
    assert (gmpo.log_clip_low, gmpo.log_clip_high) == (0.4, 0.4)
    # SAPO paper / TRL GRPOConfig: tau_pos 1.0, tau_neg 1.05.
    sapo = get_policy_loss("sapo").config_cls()
    assert (sapo.gate, sapo.tau_pos, sapo.tau_neg) == ("sigmoid", 1.0, 1.05)
