"""SPPO critic maths on toy batches worked by hand: BCE target, loss, advantage, prompt packing and
layer truncation (arXiv 2604.08865; modules nemo_sspo.algorithms.critic, nemo_sspo.algorithms.batch and
nemo_sspo.megatron.value_model)."""

import math

import pytest
import torch

from nemo_sspo.algorithms.batch import pack_critic_batch
from nemo_sspo.algorithms.critic import critic_advantages, critic_loss, critic_targets
from nemo_sspo.megatron.value_model import truncate_layers

LN2, LN3 = math.log(2.0), math.log(3.0)


def test_bce_target_loss_and_advantage_by_hand():
    # Two prompts, G = 2: rewards [1, 0 | 1, 1] -> targets (mean per prompt) [0.5, 1.0].
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    targets = critic_targets(rewards, 2)
    assert targets.tolist() == [0.5, 1.0]
    # V = [0, ln 3] -> p = sigmoid(V) = [0.5, 0.75].
    logits = torch.tensor([0.0, LN3], requires_grad=True)
    loss = critic_loss(logits, targets)
    # BCE(0.5, 0.5) = -(0.5 ln 0.5 + 0.5 ln 0.5) = ln 2 = 0.693147
    # BCE(0.75, 1)  = -ln 0.75 = 0.287682
    assert loss.tolist() == pytest.approx([LN2, -math.log(0.75)], abs=1e-6)
    # dBCE/dV = p - target: [0.5 - 0.5, 0.75 - 1] = [0, -0.25]
    loss.sum().backward()
    assert logits.grad.tolist() == pytest.approx([0.0, -0.25], abs=1e-6)
    # A_i = r_i - p(x_i): [1 - 0.5, 0 - 0.5, 1 - 0.75, 1 - 0.75] = [0.5, -0.5, 0.25, 0.25]
    adv = critic_advantages(rewards, logits, 2)
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.25, 0.25], abs=1e-6)
    assert adv.dtype == torch.float32 and not adv.requires_grad


def test_group_mean_target_equals_mean_of_per_response_bce():
    # BCE is linear in the target: BCE(p, mean r) = mean BCE(p, r_i), so one row per prompt is exact.
    logit = torch.tensor([0.3])
    per_response = critic_loss(logit.repeat(3), torch.tensor([1.0, 0.0, 1.0])).mean()
    assert critic_loss(logit, critic_targets(torch.tensor([1.0, 0.0, 1.0]), 3)).item() == pytest.approx(
        per_response.item(), abs=1e-7)


def test_one_sample_per_prompt():
    # G = 1: the target is the reward itself; V = -ln 3 -> p = 0.25, A = r - 0.25.
    rewards = torch.tensor([1.0, 0.0])
    assert critic_targets(rewards, 1).tolist() == [1.0, 0.0]
    assert critic_advantages(rewards, torch.tensor([-LN3, -LN3]), 1).tolist() == pytest.approx([0.75, -0.25])


def test_rewards_outside_unit_interval_are_refused():
    with pytest.raises(ValueError, match=r"rewards in \[0, 1\]"):
        critic_targets(torch.tensor([1.0, -0.5]), 1)
    with pytest.raises(ValueError, match="samples_per_prompt=2"):
        critic_targets(torch.tensor([1.0, 0.0, 1.0]), 2)


def test_pack_critic_batch_one_right_padded_row_per_prompt():
    pad = 0
    # Two groups of G = 2 with left-padded prompts [5, 6] and [4, 5, 6].
    prompt_ids = torch.tensor([[pad, 5, 6], [pad, 5, 6], [4, 5, 6], [4, 5, 6]])
    batch = pack_critic_batch(prompt_ids, prompt_ids != pad, torch.tensor([1.0, 0.0, 0.0, 0.0]), 2, pad_id=pad)
    assert batch.input_ids.tolist() == [[5, 6, pad], [4, 5, 6]]
    assert batch.last_index.tolist() == [1, 2]  # V is read at each prompt's last token
    assert batch.position_ids.tolist() == [[0, 1, 2]] * 2
    assert batch.targets.tolist() == [0.5, 0.0]
    assert batch.select(slice(1, 2)).input_ids.tolist() == [[4, 5, 6]]


def test_truncate_layers_keeps_the_first_layers():
    from types import SimpleNamespace

    config = SimpleNamespace(num_hidden_layers=3, layer_types=["full_attention"] * 3)
    state = {"model.embed_tokens.weight": 0, "model.layers.0.mlp.w": 1, "model.layers.2.mlp.w": 2,
             "model.layers.10.mlp.w": 3, "model.norm.weight": 4}
    config2, state2 = truncate_layers(config, state, 1)
    assert config2.num_hidden_layers == 1 and config2.layer_types == ["full_attention"]
    assert config.num_hidden_layers == 3  # the original is untouched
    assert sorted(state2) == ["model.embed_tokens.weight", "model.layers.0.mlp.w", "model.norm.weight"]
    with pytest.raises(ValueError, match="num_layers=4 must be in"):
        truncate_layers(config, state, 4)
