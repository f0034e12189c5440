"""Extension seams of the loss registry and the config layer: a loss defined in a user's own file is
selectable with ``loss=<name>``, Hydra lists every loss once, and the registry keeps loss configs flat."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from nemo_sspo.algorithms.losses import (
    LossInputs,
    LossRecord,
    LossTerms,
    PolicyLossConfig,
    compute_policy_loss,
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
    unregister_policy_loss,
)
from nemo_sspo.algorithms.losses.ratio_clip import GRPOLossConfig
from nemo_sspo.cli import DEFAULT_CONFIG_DIR, load_config
from nemo_sspo.trainer.config import register_config_nodes

# A REINFORCE-style loss, -A log pi per token, written the way docs/extending.md tells a newcomer.
USER_LOSS = '''
from dataclasses import dataclass

import torch

from nemo_sspo.algorithms.losses import LossRecord, LossTerms, PolicyLossConfig, register_policy_loss


@dataclass
class ReinforceConfig(PolicyLossConfig):
    """-A log pi per token."""

    aggregation: str = "token-mean"
    scale: float = 1.0


def build(config):
    def objective(inputs, segments):
        mask = inputs.response_mask
        zero = torch.zeros((), dtype=inputs.logprobs.dtype)
        loss = torch.where(mask, -config.scale * inputs.advantages[:, None] * inputs.logprobs, zero)
        log_ratio = torch.where(mask, (inputs.logprobs - inputs.old_logprobs).detach(), zero)
        return LossTerms(loss, mask, segments, log_ratio, torch.exp(log_ratio))
    return objective


register_policy_loss(LossRecord("{name}", ReinforceConfig, build, unit="token"))
'''


@pytest.fixture
def user_loss_file(tmp_path):
    """A plugin file registering the loss ``user_reinforce``; unregistered afterwards."""
    path = tmp_path / "user_reinforce_loss.py"
    path.write_text(USER_LOSS.replace("{name}", "user_reinforce"))
    yield path
    if "user_reinforce" in policy_loss_names():
        unregister_policy_loss("user_reinforce")
    sys.modules.pop("nemo_sspo_plugin_user_reinforce_loss", None)


def test_user_loss_file_is_selectable_by_config_alone(user_loss_file):
    cfg = load_config(overrides=[f"plugins=[{user_loss_file}]", "loss=user_reinforce",
                                 "loss.params.scale=2.0"])
    assert cfg.loss.name == "user_reinforce" and cfg.loss.params.scale == 2.0
    # Its value by hand: A = [1, -1], log pi = [[-1, -2], [-3, pad]], token mean over 3 tokens:
    # -2 * (1 * -1 + 1 * -2 + (-1) * -3) / 3 = -2 * 0 / 3 = 0; with A = [1, 1]: -2 * (-6) / 3 = 4.
    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    loss, _ = compute_policy_loss("user_reinforce", LossInputs(logprobs, logprobs, torch.tensor([1.0, 1.0]),
                                                               mask), scale=2.0)
    assert loss.item() == pytest.approx(4.0)


def test_unknown_plugin_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="plugins: cannot import 'no_such_module_xyz'"):
        load_config(overrides=["plugins=[no_such_module_xyz]"])
    with pytest.raises(ValueError, match="is not a file"):
        load_config(overrides=[f"plugins=[{tmp_path / 'missing.py'}]"])


def test_hydra_lists_every_loss_once_from_the_registry():
    register_config_nodes()  # as load_config does after importing plugins
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(DEFAULT_CONFIG_DIR), version_base=None):
        choices = GlobalHydra.instance().config_loader().get_group_options("loss")
    GlobalHydra.instance().clear()
    # Every registered loss once (a node made from its config class), plus the one YAML variant.
    assert sorted(choices) == sorted([*policy_loss_names(), "sspo_7b"])
    assert all(load_config(overrides=[f"loss={name}"]).loss.params == get_policy_loss(name).config_cls()
               for name in ("grpo", "cispo"))


@pytest.mark.parametrize("name", policy_loss_names())
def test_every_registered_loss_loads_as_a_group(name):
    # loss=<name> composes the node made from the loss's config class: its defaults, its name.
    cfg = load_config(overrides=[f"loss={name}"])
    assert cfg.loss.name == name and cfg.loss.params == get_policy_loss(name).config_cls()


def test_dapo_asks_for_dynamic_sampling_and_the_config_can_refuse():
    assert load_config(overrides=["loss=dapo"]).rollout.sampling.dynamic_sampling is True
    assert load_config(overrides=["loss=grpo"]).rollout.sampling.dynamic_sampling is False
    assert load_config(overrides=["loss=dapo", "rollout.sampling.dynamic_sampling=false"]).rollout.sampling.dynamic_sampling is False


def test_registry_refuses_a_config_that_inherits_another_loss():
    @dataclass
    class Derived(GRPOLossConfig):
        extra: float = 1.0

    with pytest.raises(ValueError, match="only base is PolicyLossConfig"):
        register_policy_loss(LossRecord("derived_loss", Derived, lambda c: None, unit="token"))
    assert "derived_loss" not in policy_loss_names()


def test_loss_terms_defaults_for_an_objective_without_clip():
    # Two rows; segments [[0, 0, 1], [0, -1, -1]]: segment lengths [[2, 2, 1], [1, 0, 0]].
    mask = torch.tensor([[True, True, True], [True, False, False]])
    segments = torch.tensor([[0, 0, 1], [0, -1, -1]])
    zeros = torch.zeros(2, 3)
    terms = LossTerms(zeros, mask, segments, zeros, torch.ones(2, 3))
    assert terms.segment_length.tolist() == [[2.0, 2.0, 1.0], [1.0, 0.0, 0.0]]
    for flag in (terms.clip_low, terms.clip_high, terms.clip_dual, terms.grad_zero):
        assert flag.dtype == torch.bool and not flag.any()
    assert isinstance(PolicyLossConfig(), PolicyLossConfig)


def test_unknown_loss_names_plugins_as_the_way_to_add_one():
    with pytest.raises(ValueError) as err:
        load_config(overrides=["loss=no_such_loss"])
    message = str(err.value)
    assert "loss=no_such_loss is neither a registered policy loss nor a variant YAML" in message
    assert "'grpo'" in message and "plugins=[my_loss.py] loss=no_such_loss" in message
    with pytest.raises(ValueError, match=r"loss.name='no_such_loss' is not a registered policy loss; .*plugins=\["):
        load_config(overrides=["loss.name=no_such_loss"])


@dataclass
class _MaskConfig(PolicyLossConfig):
    """-A log pi per token (test loss)."""

    aggregation: str = "token-mean"


def _mask_loss(narrow: bool, extra: dict | None = None):
    """-A log pi per token; returns a copy of the input mask, or one without its last column."""

    def objective(inputs, segments):
        mask = inputs.response_mask.clone()
        if narrow:
            mask[:, -1] = False
        zero = torch.zeros((), dtype=inputs.logprobs.dtype)
        loss = torch.where(mask, -inputs.advantages[:, None] * inputs.logprobs, zero)
        log_ratio = torch.where(mask, (inputs.logprobs - inputs.old_logprobs).detach(), zero)
        return LossTerms(loss, mask, segments, log_ratio, torch.exp(log_ratio), extra_metrics=extra or {})

    return lambda config: objective


@pytest.fixture
def mask_losses():
    """Registers ``mask_copy``, ``mask_narrow`` and ``mask_extra_clash``; removed afterwards."""
    from nemo_sspo.metrics import mean_pair

    records = [LossRecord("mask_copy", _MaskConfig, _mask_loss(False), unit="token"),
               LossRecord("mask_narrow", _MaskConfig, _mask_loss(True), unit="token"),
               LossRecord("mask_extra_clash", _MaskConfig,
                          _mask_loss(False, {"policy/ratio": mean_pair(1.0, 1.0)}), unit="token")]
    for record in records:
        register_policy_loss(record)
    yield
    for record in records:
        unregister_policy_loss(record.name)


def test_the_denominator_counts_the_input_mask_and_a_narrower_one_is_refused(mask_losses):
    logprobs = torch.tensor([[-1.0, -3.0], [-2.0, -4.0]])
    mask = torch.tensor([[True, True], [True, False]])
    inputs = LossInputs(logprobs, logprobs, torch.tensor([1.0, 1.0]), mask)
    # An equal copy is accepted: token mean over the 3 valid tokens, -(-1 - 3 - 2) / 3 = 2.
    loss, _ = compute_policy_loss("mask_copy", inputs)
    assert loss.item() == pytest.approx(2.0)
    # Dropping column 1 would give -(-1 - 2) / 2 = 1.5 if honoured, (1 + 2) / 3 = 1 if ignored: refused.
    with pytest.raises(ValueError, match="loss 'mask_narrow': LossTerms.response_mask differs from "
                                         "LossInputs.response_mask; .* set its per_token_loss to 0 and its grad_zero"):
        compute_policy_loss("mask_narrow", inputs)
    with pytest.raises(ValueError, match=r"extra_metrics keys \['policy/ratio'\] are shared metrics"):
        compute_policy_loss("mask_extra_clash", inputs)
