"""Regression tests: host adapters reject settings they cannot run when they are built (not at
the first loss call); verl rejects float ids."""

from __future__ import annotations

import enum
import sys
import types

import pytest
import torch

from nemo_sspo.integrations.nemo_aligner import make_actor_loss_func

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)


class _LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class _LossInputType(enum.Enum):
    LOGIT = "logit"
    LOGPROB = "logprob"


class _MetricNormalizer(enum.Enum):
    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"


@pytest.fixture
def nemo_rl(monkeypatch):
    leaf = "nemo_rl.algorithms.loss.interfaces"
    for name in ("nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.loss", leaf):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[leaf].LossType = _LossType
    sys.modules[leaf].LossInputType = _LossInputType
    sys.modules[leaf].MetricNormalizer = _MetricNormalizer
    from nemo_sspo.integrations.nemo_rl import NeMoRLPolicyLoss
    return NeMoRLPolicyLoss


_BAD = [("dr_grpo", None, r"max_response_length"),
        ("grpo", {"kl_coef": 0.1}, r"kl_coef=0.1.*no reference log-probs"),
        ("grpo", {"entropy_coef": 0.01}, r"entropy_coef=0.01"),
        ("sspo", None, r"tables=")]
# NeMo-RL passes reference_policy_logprobs, so kl_coef > 0 is runnable there.
_BAD_NEMO_RL = [case for case in _BAD if "kl_coef" not in (case[1] or {})]


@pytest.mark.parametrize("name, config, match", _BAD_NEMO_RL)
def test_nemo_rl_rejects_at_init(nemo_rl, name, config, match):
    with pytest.raises(ValueError, match=match):
        nemo_rl(name, config)


def test_nemo_rl_accepts_runnable_settings(nemo_rl):
    nemo_rl("dr_grpo", max_response_length=8)
    nemo_rl("grpo")
    assert "reference_policy_logprobs" in nemo_rl("grpo", {"kl_coef": 0.1}).required_keys


def test_nemo_rl_zero_global_normaliser_gives_zero_loss_and_gradient(nemo_rl):
    """No valid token anywhere (global counts 0): loss 0 and a zero gradient, on both inputs."""
    torch.manual_seed(0)
    B, S, V = 2, 6, 8
    token_mask = torch.zeros(B, S)
    token_mask[:, 3:] = 1
    data = {"input_ids": torch.randint(0, V, (B, S)), "token_mask": token_mask,
            "sample_mask": torch.zeros(B), "advantages": torch.tensor([1.0, -1.0])[:, None] *
            token_mask, "prev_logprobs": -torch.rand(B, S)}
    zero = {"global_valid_seqs": torch.tensor(0.0), "global_valid_toks": torch.tensor(0.0)}
    logits = torch.randn(B, S, V, requires_grad=True)
    for loss_fn, key in ((nemo_rl("grpo", {"aggregation": "token-mean"}), "next_token_logprobs"),
                         (nemo_rl("grpo", {"aggregation": "seq-mean-token-mean"}),
                          "next_token_logprobs"),
                         (nemo_rl("sspo", {"segmentation": "fixed_k", "segment_k": 2}), "logits")):
        logprobs = torch.log_softmax(logits[:, :-1], -1).gather(
            -1, data["input_ids"][:, 1:, None])[..., 0]
        inputs = {key: logits if key == "logits" else logprobs}
        loss, metrics = loss_fn(data, **zero, **inputs)
        (grad,) = torch.autograd.grad(loss, logits)
        assert loss.item() == 0.0 and metrics["loss"] == 0.0
        assert torch.equal(grad, torch.zeros_like(grad))


def _aligner_batch():
    B, S = 2, 6
    return {"response_tokens": torch.randint(0, 8, (B, S)), "mask": torch.ones(B, S - 1),
            "advantages": torch.tensor([1.0, -1.0])[:, None].expand(B, S - 1),
            "prev_logprobs": -torch.rand(B, S - 1), "prev_entropy": torch.rand(B, S - 1)}


@pytest.mark.parametrize("name, config, match", _BAD)
def test_nemo_aligner_rejects_at_factory(name, config, match):
    with pytest.raises(ValueError, match=match):
        make_actor_loss_func(_aligner_batch(), loss_name=name, loss_config=config, tp_group=None,
                             dp_group=None)


def test_nemo_aligner_last_token_error_does_not_advise_kl_coef():
    loss_func = make_actor_loss_func(_aligner_batch(), loss_name="grpo", tp_group=None,
                                     dp_group=None, advantage_layout="last_token")
    with pytest.raises(ValueError) as err:
        loss_func(torch.randn(2, 6, 8))
    assert "kl_coef" not in str(err.value) and "initial_policy_kl_penalty" in str(err.value)


def test_verl_float_segment_ids():
    from nemo_sspo.integrations.verl import _integer_segment_ids

    with pytest.raises(ValueError, match="non-integer"):
        _integer_segment_ids(torch.tensor([[0.0, 0.5]]))
    assert _integer_segment_ids(torch.tensor([[0.0, 1.0]])).dtype == torch.int64


@pytest.mark.parametrize("args, match", [
    ({"sspo": {"kl_coef": 0.1}}, r"use_kl_loss"),
    ({"grpo": {"entropy_coef": 0.01}}, r"entropy_coeff"),
    ({"sspo": {"aggregation": "token-mean"}}, r"loss_agg_mode"),
])
def test_verl_register_rejects_unrunnable_settings(args, match):
    pytest.importorskip("verl.trainer.ppo.core_algos")
    from nemo_sspo.integrations import verl as sspo_verl

    with pytest.raises(ValueError, match=match):
        sspo_verl.register(loss_args=args)
    sspo_verl.register()  # leave the default registration in place
