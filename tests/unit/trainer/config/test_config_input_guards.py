"""Regression tests: config values, config-building messages, segment-id ranges, the covariance
quota and the SPPO critic helpers reject or handle what they used to accept silently."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from nemo_sspo.algorithms.losses import (
    LossInputs,
    build_policy_loss_config,
    get_policy_loss,
    make_policy_loss,
    policy_loss_names,
    select_high_covariance_tokens,
)
from nemo_sspo.algorithms.critic import critic_advantages, critic_targets
from nemo_sspo.trainer.config import unknown_key_message


def _numeric_fields(config_cls):
    out = []
    for f in dataclasses.fields(config_cls):
        parts = {p.strip() for p in str(f.type).split("|")}
        if "float" in parts:
            out.append((f.name, "float"))
        elif "int" in parts:
            out.append((f.name, "int"))
    return out


@pytest.mark.parametrize("name", policy_loss_names())
def test_every_float_field_rejects_nan_inf_and_bool(name):
    cls = get_policy_loss(name).config_cls
    cls()  # defaults stay valid
    fields = _numeric_fields(cls)
    assert fields, f"{cls.__name__} has no numeric field"
    for field, kind in fields:
        bad = [True, False] + ([math.nan, math.inf, -math.inf, "0.1"] if kind == "float" else [])
        for value in bad:
            with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{field}="):
                cls(**{field: value})


@pytest.mark.parametrize("name, field", [("grpo", "eps_high"), ("sspo", "gamma"),
                                         ("sspo", "alpha"), ("sapo", "tau_pos"),
                                         ("dcpo", "ratio_max"), ("gmpo", "log_clip_high"),
                                         ("grpo", "kl_coef")])
def test_tester_nan_cases_name_class_and_field(name, field):
    cls = get_policy_loss(name).config_cls
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}=nan .*finite"):
        cls(**{field: float("nan")})


def test_kl_coef_true_is_not_one():
    with pytest.raises(ValueError, match=r"GRPOLossConfig\.kl_coef=True .*not a bool"):
        get_policy_loss("grpo").config_cls(kl_coef=True)
    assert get_policy_loss("grpo").config_cls(kl_coef=1).kl_coef == 1  # a plain int is still a number


def test_misspelt_param_names_field_lists_valid_and_suggests():
    with pytest.raises(ValueError) as err:
        build_policy_loss_config("grpo", {"kl_coeff": 0.05}, where="loss.params")
    msg = str(err.value)
    assert "loss.params.kl_coeff" in msg and "did you mean 'kl_coef'" in msg
    # PolicyLossConfig's three fields, then GRPOLossConfig's own three, in declaration order.
    assert msg.endswith("Valid fields: aggregation, kl_coef, kl_estimator, "
                        "entropy_coef, eps_low, eps_high, dual_clip_c")
    assert "loss.name" not in msg  # kl_coeff is no other loss's field: no group hint


def test_group_hint_only_when_key_belongs_to_another_loss():
    # The registry names the owners in its own terms; the config layer adds the YAML hint.
    with pytest.raises(ValueError, match=r"^params\.gamma: .*'gamma' is a field of the losses \['sspo'\], "
                                         r"not of 'grpo'$"):
        build_policy_loss_config("grpo", {"gamma": 2.2})
    assert re.search(r"^loss\.params\.gamma: .*\['sspo'\].*`loss=sspo`.*rather than setting loss\.name$",
                     unknown_key_message("loss.params.gamma", "grpo"))
    assert "loss=" not in unknown_key_message("loss.params.no_such_key", "grpo")
    with pytest.raises(ValueError) as err:
        build_policy_loss_config("grpo", {"no_such_key": 1})
    assert "loss.name" not in str(err.value) and "did you mean" not in str(err.value)


def test_wrong_type_names_field():
    with pytest.raises(ValueError, match=r"GRPOLossConfig\.eps_low='abc'"):
        build_policy_loss_config("grpo", {"eps_low": "abc"})


def test_segmentation_on_fixed_unit_loss_names_configurable_losses():
    configurable = sorted(n for n in policy_loss_names() if "segmentation" in
                          {f.name for f in dataclasses.fields(get_policy_loss(n).config_cls)})
    assert "sspo" in configurable and "grpo" not in configurable
    with pytest.raises(ValueError) as err:
        build_policy_loss_config("grpo", {"segmentation": "newline"})
    msg = str(err.value)
    assert "fixed" in msg and "'token'" in msg and str(configurable) in msg


def test_renamed_aggregation_hint_at_config_time():
    with pytest.raises(ValueError, match=r"GRPOLossConfig\.aggregation='seq-mean-token-sum-norm'"
                                         r".*'constant-denominator'"):
        build_policy_loss_config("grpo", {"aggregation": "seq-mean-token-sum-norm"})


def test_build_policy_loss_config_defaults_and_overrides():
    assert build_policy_loss_config("sspo", {"gamma": 2.2}).gamma == 2.2
    assert build_policy_loss_config("grpo") == get_policy_loss("grpo").config_cls()


def _sspo_inputs(segment_ids):
    torch.manual_seed(0)
    lp = -torch.rand(2, 4, dtype=torch.float64)
    return dict(logprobs=lp, old_logprobs=lp + 0.05, advantages=torch.tensor([1.0, -1.0],
                dtype=torch.float64), response_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]],
                dtype=torch.bool), segment_ids=segment_ids,
                old_entropy=torch.rand(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("ids, bad", [
    ([[0, 0, 4, -1], [0, 1, 1, 2]], "[0, 4]"),      # id T=4 at a valid token
    ([[0, -1, 1, -1], [0, 1, 1, 2]], "[-1, 2]"),    # -1 at a valid token
])
def test_segment_ids_out_of_range_at_valid_tokens_raise(ids, bad):
    loss = make_policy_loss("sspo")
    inputs = LossInputs(**_sspo_inputs(torch.tensor(ids)))
    with pytest.raises(ValueError, match=r"segment_ids .*" + __import__("re").escape(bad)
                                         + r".*\[0, 3\]"):
        loss(inputs)


def test_segment_ids_in_range_and_garbage_at_masked_positions_pass():
    # Every token log-ratio is lp - (lp + 0.05) = -0.05, so every segment ratio is e^-0.05 =
    # 0.951229 whatever the ids; with H in [0, 1) the SSPO bounds are b_low <= beta 0.8 and
    # b_high >= 1, GRPO's [0.8, 1.2]: nothing is clipped and each token's loss is -s A.
    expected = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    expected *= math.exp(-0.05)
    out = make_policy_loss("sspo")(LossInputs(**_sspo_inputs(torch.tensor([[0, 0, 3, 99], [0, 1, 1, 3]]))))
    torch.testing.assert_close(out.per_token_loss, expected, rtol=1e-12, atol=0.0)
    # token-level losses do not read segment_ids
    out = make_policy_loss("grpo")(LossInputs(**_sspo_inputs(torch.full((2, 4), 7))))
    torch.testing.assert_close(out.per_token_loss, expected, rtol=1e-12, atol=0.0)


def test_covariance_quota_is_at_least_one_token():
    # Cov_t = (lp - mean lp)(A - mean A) with mean lp = -1.5, mean A = 0:
    # row 0 (A=1): 0.5, -0.5; row 1 (A=-1): -0.5, 0.5 -> the tie at 0.5 keeps (0, 0).
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    selected, cov = select_high_covariance_tokens(lp, adv, mask, 2e-4)  # floor(2e-4 * 4) = 0
    torch.testing.assert_close(cov, torch.tensor([[0.5, -0.5], [-0.5, 0.5]]))
    assert selected.tolist() == [[True, False], [False, False]]
    assert not select_high_covariance_tokens(lp, adv, mask, 0.0)[0].any()
    assert not select_high_covariance_tokens(lp, adv, torch.zeros_like(mask), 0.5)[0].any()
    # floor above 1 is unchanged: 0.5 * 4 = 2 tokens
    assert select_high_covariance_tokens(lp, adv, mask, 0.5)[0].sum() == 2


def test_clip_cov_zeroes_the_one_selected_token_at_small_scale():
    lp = torch.tensor([[-1.0, -2.0], [-1.5, -2.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    # mean log p = -1.625, token advantages [1, 1, -1, -1] (mean 0): Cov = [[0.625, -0.375],
    # [-0.125, 0.375]]. Only (0, 0) lies inside the strict band (0.5, 5), and the quota
    # max(1, floor(2e-4 * 4)) = 1 takes it whatever the random draw.
    cls = get_policy_loss("clip_cov").config_cls
    per_token = make_policy_loss("clip_cov", cls(cov_min=0.5))(LossInputs(
        logprobs=lp, old_logprobs=lp.detach(), advantages=torch.tensor([1.0, -1.0], dtype=torch.float64),
        response_mask=mask, segment_ids=torch.zeros(2, 2, dtype=torch.long),
        old_entropy=torch.zeros(2, 2, dtype=torch.float64))).per_token_loss
    per_token.sum().backward()
    # on-policy: d(-r A)/d lp = -A, except the selected token (0, 0), whose loss is zeroed
    assert lp.grad.tolist() == [[0.0, -1.0], [1.0, 1.0]]
    assert per_token.detach().tolist() == [[0.0, -1.0], [1.0, 1.0]]


def test_critic_targets_rejects_nan():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        critic_targets(torch.tensor([1.0, float("nan")]), 1)
    torch.testing.assert_close(critic_targets(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2),
                               torch.tensor([0.5, 1.0]))


def test_critic_advantages_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"value_logits has shape \(1,\) but must be .*\[4\]"):
        critic_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.0]), 1)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        critic_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.0]), 0)
    # sigmoid(0) = 0.5 per prompt, repeated over its G = 2 responses
    torch.testing.assert_close(
        critic_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.0, 0.0]), 2),
        torch.tensor([0.5, -0.5, 0.5, 0.5]))
