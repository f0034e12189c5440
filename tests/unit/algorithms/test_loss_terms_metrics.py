"""Shared parts of the loss family: reference-KL and entropy terms, the metric pairs (hand-worked on
one batch), config validation of every loss, and the registry. The pair kinds themselves:
tests/unit/metrics/test_metric_pairs.py."""

import math

import pytest
import torch

from nemo_sspo.algorithms.aggregation import aggregate
from nemo_sspo.algorithms.kl import kl_estimate
from nemo_sspo.algorithms.losses import (
    CISPOLossConfig,
    ClipCovLossConfig,
    DCPOLossConfig,
    GMPOLossConfig,
    GRPOLossConfig,
    KLCovLossConfig,
    SAPOLossConfig,
    SoftGate,
    SoftSeqPOLossConfig,
    SSPOFixedClipConfig,
    SSPOLossConfig,
    LossInputs,
    get_policy_loss,
    make_policy_loss,
    policy_loss_names,
    register_soft_gate,
    soft_gate_names,
    unregister_soft_gate,
)
from nemo_sspo.algorithms.losses.metrics import ENTROPY_BAND_KEYS
from nemo_sspo.metrics import summarize_metric_pairs
from tests.unit.loss_cases import LOSS_CASES

ALL_NAMES = sorted(LOSS_CASES)  # the one table of per-loss hand values


def _call(name, config, logprobs, old, advantages, mask, segment_ids, old_entropy, **optional):
    """``(per_token_loss, metrics)`` of loss ``name`` bound to ``config`` (its defaults if None);
    ``optional``: ref_logprobs / entropy / token_weights."""
    out = make_policy_loss(name, config)(LossInputs(
        logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask,
        segment_ids=segment_ids, old_entropy=old_entropy, **optional))
    return out.per_token_loss, out.metrics


def test_registry_holds_the_family():
    assert policy_loss_names() == ALL_NAMES
    for name in ALL_NAMES:
        record = get_policy_loss(name)
        config_cls = record.config_cls
        config = config_cls()
        loss = make_policy_loss(name, config)
        # The ratio unit: fixed by the record, or the config's own field (never both).
        assert (record.unit is None) == hasattr(config, "segmentation"), name
        assert isinstance(loss.requirements.segmentation, str)
        assert loss.requirements.segmentation == (record.unit or config.segmentation)
        # Each config names its source: a paper (LPO: the Ling 2.0 report, arXiv 2510.22115), or
        # says the method is ours.
        assert "arXiv" in config_cls.__doc__ or "ours" in config_cls.__doc__, name
        assert type(loss).__call__.__doc__ and "minimise" in type(loss).__call__.__doc__


# ----------------------------------------------------------------------------- additive terms

@pytest.mark.parametrize(("estimator", "value", "slope"), [
    # logpi = ln 0.5, log ref = ln 0.25 -> l = ref - logpi = ln 0.5 = -0.693147.
    ("k1", math.log(2.0), 1.0),                       # -l; d/dlogpi = +1
    ("k2", 0.5 * math.log(2.0) ** 2, math.log(2.0)),  # l^2/2; d/dlogpi = -l
    ("k3", 0.5 - 1 + math.log(2.0), 0.5),             # e^l - 1 - l; d/dlogpi = 1 - e^l
])
def test_reference_kl_term(estimator, value, slope):
    # On-policy (ratio 1) with A = 0: only the KL term is left. kl_coef 0.1, 2 tokens.
    logprobs = torch.full((1, 2), math.log(0.5), dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 2), math.log(0.25), dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    config = GRPOLossConfig(kl_coef=0.1, kl_estimator=estimator)
    loss, metrics = _call("grpo", config, logprobs, logprobs.detach(),
                          torch.zeros(1, dtype=torch.float64), mask,
                          torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.float64),
                          ref_logprobs=ref)
    assert torch.allclose(loss, torch.full((1, 2), 0.1 * value, dtype=torch.float64), atol=1e-12)
    num, den = aggregate(loss, mask, config.aggregation)
    (num / den).backward()
    assert torch.allclose(logprobs.grad, torch.full((1, 2), 0.1 * slope / 2, dtype=torch.float64),
                          atol=1e-12)
    assert metrics["policy/kl_ref"].total.item() == pytest.approx(2 * value, abs=1e-6)


def test_entropy_bonus_and_reporting():
    logprobs = torch.zeros(1, 3, requires_grad=True)
    entropy = torch.tensor([[0.5, 1.0, 9.0]], requires_grad=True)  # last position masked
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    args = (logprobs, logprobs.detach(), torch.tensor([1.0]), mask, torch.zeros(1, 3, dtype=torch.long),
            torch.zeros(1, 3))
    loss, metrics = _call("sspo", SSPOLossConfig(entropy_coef=0.2), *args, entropy=entropy)
    # -A (ratio 1) - 0.2 H per token: [-1.1, -1.2, 0].
    assert torch.allclose(loss, torch.tensor([[-1.1, -1.2, 0.0]]), atol=1e-6)
    loss.sum().backward()
    assert torch.allclose(entropy.grad, torch.tensor([[-0.2, -0.2, 0.0]]))
    assert metrics["policy/entropy_current"].as_tensor().tolist() == [1.5, 2.0]
    # With coefficient 0 the entropy is only reported.
    loss, metrics = _call("sspo", SSPOLossConfig(), *args, entropy=entropy)
    assert torch.allclose(loss, torch.tensor([[-1.0, -1.0, 0.0]]))
    assert "policy/entropy_current" in metrics and "policy/kl_ref" not in metrics


@pytest.mark.parametrize(("params", "kwargs", "pattern"), [
    (dict(kl_coef=0.1), {}, r"kl_coef=0.1 needs LossInputs\.ref_logprobs"),
    (dict(entropy_coef=0.1), {}, r"entropy_coef=0.1 needs LossInputs\.entropy"),
    ({}, dict(ref_logprobs=torch.zeros(1, 3)), r"LossInputs\.ref_logprobs has shape \(1, 3\)"),
    ({}, dict(entropy=torch.zeros(2, 2)), r"LossInputs\.entropy has shape \(2, 2\)"),
])
def test_additive_term_errors(params, kwargs, pattern):
    # A missing tensor is reported when the loss is called, a wrong shape when the inputs are built.
    loss = make_policy_loss("gmpo", GMPOLossConfig(**params))
    with pytest.raises(ValueError, match=pattern):
        loss(LossInputs(logprobs=torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2),
                        advantages=torch.zeros(1), response_mask=torch.ones(1, 2, dtype=torch.bool),
                        segment_ids=torch.zeros(1, 2, dtype=torch.long),
                        old_entropy=torch.zeros(1, 2), **kwargs))


def test_kl_estimators_by_hand():
    l = torch.tensor([0.0, math.log(2.0)])
    assert kl_estimate(l, "k1").tolist() == pytest.approx([0.0, -math.log(2.0)])
    assert kl_estimate(l, "k3").tolist() == pytest.approx([0.0, 2 - 1 - math.log(2.0)])
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(l, "k4")


# ----------------------------------------------------------------------------- metrics by hand

def test_metrics_hand_worked():
    # sspo_fixed_clip, bounds [0.8, 1.2].
    # Row 0 (A = +1): segments [t0 t1 | t2 t3], d = [.4, 0 | -.2, -.2]
    #   seg0 s = e^0.2 = 1.2214 > 1.2 -> clipped high; seg1 s = e^-0.2 inside.
    # Row 1 (A = -1): segments [t0 | t1 t2], d = [-.5 | .1, .1], t3 masked
    #   seg0 s = e^-0.5 < 0.8 -> clipped low; seg1 s = e^0.1 inside.
    d = torch.tensor([[0.4, 0.0, -0.2, -0.2], [-0.5, 0.1, 0.1, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    segments = torch.tensor([[0, 0, 1, 1], [0, 1, 1, -1]])
    # Segment entropies 0.1 | 0.4 | 0.9 | 1.3: one segment in each band.
    entropy = torch.tensor([[0.1, 0.1, 0.3, 0.5], [0.9, 1.2, 1.4, 5.0]], dtype=torch.float64)
    _, m = _call("sspo_fixed_clip", None, d, torch.zeros_like(d),
                 torch.tensor([1.0, -1.0], dtype=torch.float64), mask, segments, entropy)

    def value(key):
        return (m[key].total / m[key].count).item()

    assert value("policy/clipfrac_tokens") == pytest.approx(3 / 7)
    assert value("policy/clipfrac_high_tokens") == pytest.approx(2 / 7)
    assert value("policy/clipfrac_low_tokens") == pytest.approx(1 / 7)
    assert m["policy/clipfrac_dual_tokens"].as_tensor().tolist() == [0.0, 7.0]
    assert value("policy/clipfrac_segments") == pytest.approx(2 / 4)
    assert value("policy/clipfrac_high_segments") == pytest.approx(1 / 4)
    # Responses: row 0 has 2 of 4 tokens clipped, row 1 1 of 3 -> (1/2 + 1/3) / 2 = 5/12.
    assert value("policy/clipfrac_responses") == pytest.approx(5 / 12)
    assert value("policy/clipfrac_high_responses") == pytest.approx(1 / 4)
    assert value("policy/clipfrac_low_responses") == pytest.approx(1 / 6)
    assert value("policy/zero_grad_frac_tokens") == pytest.approx(3 / 7)
    e = math.exp
    tokens = [0.4, 0.0, -0.2, -0.2, -0.5, 0.1, 0.1]
    assert value("policy/ratio_token") == pytest.approx(sum(e(x) for x in tokens) / 7, rel=1e-6)
    assert summarize_metric_pairs(m)["policy/ratio_token_sq"] == pytest.approx(sum(e(2 * x) for x in tokens) / 7,
                                                                               rel=1e-6)
    assert m["policy/ratio_token_min"].as_tensor().tolist() == pytest.approx([e(-0.5), 7.0], rel=1e-6)
    assert m["policy/ratio_token_max"].as_tensor().tolist() == pytest.approx([e(0.4), 7.0], rel=1e-6)
    seg = [e(0.2), e(-0.2), e(-0.5), e(0.1)]
    assert value("policy/ratio_segment") == pytest.approx(sum(seg) / 4, rel=1e-6)
    assert value("policy/ratio") == pytest.approx(sum(seg) / 4, rel=1e-6)
    assert m["policy/ratio_segment_max"].total.item() == pytest.approx(e(0.2), rel=1e-6)
    # Responses: mean d row 0 = 0 -> 1; row 1 = -0.1 -> e^-0.1.
    assert value("policy/ratio_response") == pytest.approx((1 + e(-0.1)) / 2, rel=1e-6)
    assert m["policy/ratio_response_min"].as_tensor().tolist() == pytest.approx([e(-0.1), 2.0], rel=1e-6)
    assert value("policy/approx_kl_k1") == pytest.approx(0.3 / 7, rel=1e-6)
    assert value("policy/approx_kl_k3") == pytest.approx(
        sum(e(x) - 1 - x for x in tokens) / 7, rel=1e-6)
    assert value("policy/entropy") == pytest.approx(4.5 / 7)
    for key in ENTROPY_BAND_KEYS:
        assert value(key) == pytest.approx(0.25)
    assert (value("policy/b_low"), value("policy/b_high")) == pytest.approx((0.8, 1.2))
    assert m["policy/segments_per_response"].as_tensor().tolist() == pytest.approx([4.0, 2.0])


def test_entropy_band_edges_are_left_closed():
    # Segment entropies exactly 0.2, 0.75 and 1.0 fall in the band that starts there.
    entropy = torch.tensor([[0.2, 0.75, 1.0, 0.0]])
    _, m = _call("grpo", None, torch.zeros(1, 4), torch.zeros(1, 4), torch.ones(1),
                 torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.long), entropy)
    assert [m[k].total.item() for k in ENTROPY_BAND_KEYS] == [1.0, 1.0, 1.0, 1.0]


# ----------------------------------------------------------------------------- config validation

@pytest.mark.parametrize(("make", "pattern"), [
    (lambda: GRPOLossConfig(aggregation="mean"), r"GRPOLossConfig\.aggregation='mean'; valid"),
    (lambda: GRPOLossConfig(kl_estimator="k4"), r"kl_estimator='k4'"),
    (lambda: GRPOLossConfig(kl_coef=-1.0), r"kl_coef=-1.0"),
    (lambda: GRPOLossConfig(entropy_coef=-0.1), r"entropy_coef=-0.1"),
    (lambda: SSPOLossConfig(segmentation="paragraph"), r"segmentation='paragraph'; valid"),
    (lambda: SSPOLossConfig(segmentation="fixed_k"), r"segment_k=None: segmentation 'fixed_k'"),
    (lambda: SSPOFixedClipConfig(segment_k=4), r"segment_k=4 is only read"),
    (lambda: DCPOLossConfig(ratio_max=0.5), r"ratio_max=0.5"),
    (lambda: DCPOLossConfig(eps_low=1.5), r"eps_low=1.5"),
    (lambda: GMPOLossConfig(log_clip_high=-0.1), r"log_clip_high=-0.1"),
    (lambda: SAPOLossConfig(tau_neg=0.0), r"tau_neg=0.0"),
    (lambda: SAPOLossConfig(gate="relu"), r"gate='relu'; registered: .*arctan"),
    (lambda: SoftSeqPOLossConfig(gate="relu"), r"gate='relu'"),
    (lambda: CISPOLossConfig(eps_high_is=-1.0), r"eps_high_is=-1.0"),
    (lambda: ClipCovLossConfig(select_fraction=2.0), r"select_fraction=2.0"),
    (lambda: ClipCovLossConfig(cov_min=3.0, cov_max=1.0), r"cov_min=3.0 >= cov_max=1.0"),
    (lambda: KLCovLossConfig(cov_kl_coef=-1.0), r"cov_kl_coef=-1.0"),
])
def test_config_validation_names_the_field(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_fixed_unit_losses_reject_segmentation_override():
    with pytest.raises(TypeError):
        GRPOLossConfig(segmentation="newline")
    assert SSPOLossConfig(segmentation="fixed_k", segment_k=8).segment_k == 8
    assert not hasattr(GRPOLossConfig(), "segmentation")
    assert get_policy_loss("grpo").unit == "token" and get_policy_loss("gmpo").unit == "response"
    assert make_policy_loss("grpo").requirements.segmentation == "token"
    assert make_policy_loss("gmpo").requirements.segmentation == "response"


def test_wrong_config_type_names_expected_class():
    with pytest.raises(ValueError, match="CISPOLossConfig"):
        make_policy_loss("cispo", GRPOLossConfig())


def test_custom_gate_plugs_in():
    # softsign gate g(x) = x / (1 + tau |x|), g'(x) = 1 / (1 + tau |x|)^2.
    gate = SoftGate(lambda x, tau: x / (1 + tau * x.abs()), lambda x, tau: 1 / (1 + tau * x.abs()) ** 2)
    register_soft_gate("test_softsign", gate)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_soft_gate("test_softsign", gate)
        # d = [1, 1], tau 1: g = 0.5 each -> w = e^0.5; A = 1.
        loss, m = _call("soft_seq_po", SoftSeqPOLossConfig(gate="test_softsign"), torch.ones(1, 2),
                        torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool),
                        torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2))
        assert torch.allclose(loss, torch.full((1, 2), -math.exp(0.5)))
        assert (m["policy/gate_weight"].total / m["policy/gate_weight"].count).item() == pytest.approx(0.25)
    finally:
        unregister_soft_gate("test_softsign")
    assert "test_softsign" not in soft_gate_names()


def test_builtin_gate_slopes_match_autograd():
    from nemo_sspo.algorithms.losses import get_soft_gate

    x = torch.linspace(-4, 4, 17, dtype=torch.float64, requires_grad=True)
    tau = torch.tensor(1.3, dtype=torch.float64)
    for name in ("sigmoid", "arctan"):
        gate = get_soft_gate(name)
        (grad,) = torch.autograd.grad(gate.value(x, tau).sum(), x)
        assert torch.allclose(grad, gate.slope(x.detach(), tau), atol=1e-12)
        assert gate.value(torch.zeros(1, dtype=torch.float64), tau).item() == 0.0
        assert gate.slope(torch.zeros(1, dtype=torch.float64), tau).item() == 1.0


def test_token_ratio_spread_of_1e_7_is_not_lost_to_cancellation():
    # Token ratios 1 + k * 2^-23 (k = -1, 0, 1, 0 repeated over 2 x 2,000 tokens): population std
    # sqrt(1/2) * 2^-23 = 8.43e-8, taken in float64 from the same ratios. sqrt(E[r^2] - E[r]^2) over
    # float32 sums lost it entirely (0 or ~1e-4).
    steps = torch.tensor([-1.0, 0.0, 1.0, 0.0], dtype=torch.float64).repeat(1000).reshape(2, 2000) * 2.0 ** -23
    logprobs = torch.log1p(steps)
    mask = torch.ones(2, 2000, dtype=torch.bool)
    _, m = _call("grpo", None, logprobs, torch.zeros_like(logprobs), torch.tensor([1.0, -1.0], dtype=torch.float64),
                 mask, torch.zeros(2, 2000, dtype=torch.long), None)
    reference = torch.exp(logprobs).float().double().std(unbiased=False).item()  # the ratios as the metric holds them
    assert reference == pytest.approx(math.sqrt(0.5) * 2.0 ** -23, rel=1e-6)
    assert summarize_metric_pairs(m)["policy/ratio_token_std"] == pytest.approx(reference, rel=1e-3)
