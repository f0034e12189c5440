"""Router replay R3 in one process: the trainer runs the experts the rollout engine chose.

The engine is transformers' ``generate`` on the tiny random Qwen3-MoE whose router weights were
redrawn (std 0.5, as the checkpoint's own), so it routes most tokens elsewhere than the trainer's
Megatron model, which holds the original weights. Which experts Megatron's routers actually used is
read at the router (``tests/unit/_route_spy.py``), in the old-policy forward under every layout and
in the training forward and backward.
"""

from dataclasses import replace

import pytest
import torch

from nemo_sspo.algorithms.batch import PolicyBatch
from nemo_sspo.algorithms.losses import GRPOLossConfig, make_policy_loss
from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
from nemo_sspo.megatron import (
    build_policy_model,
    destroy_parallel,
    initialize_parallel,
    load_hf_into_megatron,
)
from nemo_sspo.megatron import training
from nemo_sspo.megatron.router_replay import routing_agreement
from nemo_sspo.megatron.step import LossSpec
from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.rollout import HFRolloutEngine
from tests.unit._route_spy import spy_routes

PROMPTS = ["Hi", "Let x = 2.\n\nThen 2x =", "Sam has 5 stamps. He buys 2 more. How many", "1 + 1 ="]


@pytest.fixture(scope="module")
def setup():
    initialize_parallel(tp_size=1, pp_size=1, seed=3)
    config, state_dict, tokenizer = load_hf_checkpoint("tiny-random-qwen3-moe")
    generator = torch.Generator().manual_seed(11)
    engine_weights = {k: 0.5 * torch.randn(v.shape, generator=generator) if k.endswith("mlp.gate.weight") else v
                      for k, v in state_dict.items()}
    engine = HFRolloutEngine(build_hf_model(config, engine_weights), tokenizer, max_new_tokens=8, temperature=1.0,
                             record_routes=True)
    rollout = engine.generate(PROMPTS, seed=4)
    segments = torch.where(rollout.response_mask, 0, -1)
    batch = PolicyBatch.from_rollout(rollout, segments, torch.ones(len(PROMPTS)), pad_id=tokenizer.pad_token_id,
                                     route_layers=[0, 1])
    model = build_policy_model(config)
    load_hf_into_megatron(model, state_dict, config)
    spec = LossSpec(loss=make_policy_loss("grpo", GRPOLossConfig(aggregation="token-mean")), tp_group=None,
                    vocab_start=0, vocab_size=config.vocab_size, temperature=1.0, max_response_length=8,
                    output_chunk_size=None)
    yield model.eval(), batch, spec
    destroy_parallel()


def _forward(model, batch, spec, layout):
    """``(logprobs [B, S], routes [B, S, L, k])`` of an old-policy forward and the experts it used."""
    (logprobs, _), routes = spy_routes(
        lambda: training.forward_logprobs(model, batch, spec, layout, dp_group=None), batch)
    return logprobs, routes


def _gap(batch, logprobs) -> float:
    return float((batch.rollout_logprobs - logprobs)[batch.loss_mask].abs().mean())


@pytest.mark.parametrize("layout", [dict(micro_batch_size=2), dict(max_tokens=48), dict(max_tokens=48, pack=True)],
                         ids=["fixed", "token-budget", "packed"])
def test_r3_trainer_uses_the_engine_experts_at_every_token(setup, layout):
    model, batch, spec = setup
    plan = MicroBatchLayout(**layout)
    valid = torch.arange(batch.input_ids.shape[1])[None, :] < batch.lengths[:, None]
    replayed, replayed_routes = _forward(model, batch, spec, plan)
    own, own_routes = _forward(model, replace(batch, routes=None), spec, plan)
    pairs = 2.0 * int(valid.sum())  # 2 MoE layers at every valid input token
    # R3: every (token, layer) of every row ran the engine's top-2 experts, whatever the layout
    assert routing_agreement(replayed_routes, batch.routes, valid).tolist() == [pairs, pairs]
    # Without replay the trainer's own router (drawn independently of the engine's) picks the
    # engine's top-2 set of 8 experts on about 1 / C(8, 2) = 1 / 28 = 0.036 of the pairs (4 of 126
    # here); for 126 pairs one standard deviation is sqrt(0.036 * 0.964 / 126) = 0.017, so 0.25 is
    # more than 12 of them above.
    matching, counted = routing_agreement(own_routes, batch.routes, valid).tolist()
    assert counted == pairs and matching / counted < 0.25
    # the gap to the engine's log-probs shrinks with the engine's experts (only the routing weights,
    # from the trainer's own router, still differ): 6.2e-3 against 7.9e-3 measured
    assert _gap(batch, replayed) < _gap(batch, own)


def test_r3_training_forward_replays_the_engine_experts(setup):
    from nemo_sspo.megatron.training import compute_gradients, wrap_for_training

    model, batch, spec = setup
    ddp, _ = wrap_for_training(model, lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
                               clip_grad=0.0)
    old = replace(batch, old_logprobs=batch.rollout_logprobs)
    plan = MicroBatchLayout(max_tokens=48, pack=True)
    _, routes = spy_routes(lambda: compute_gradients(ddp, old, spec, plan, dp_group=None), batch)
    valid = torch.arange(batch.input_ids.shape[1])[None, :] < batch.lengths[:, None]
    pairs = 2.0 * int(valid.sum())
    assert routing_agreement(routes, batch.routes, valid).tolist() == [pairs, pairs]
    assert any(p.main_grad.abs().sum() > 0 for p in ddp.parameters())  # a real backward ran


def test_thd_filler_tokens_get_routes_and_recording_drops_them(setup, monkeypatch):
    # The TransformerEngine spec pads a packed row to the THD alignment inside the forward (16
    # under FP8), so its routers see filler tokens too; emulated here on the local-spec model.
    from nemo_sspo.megatron import router_replay
    from nemo_sspo.megatron.router_replay import micro_batch_routes, moe_routers, recording_forward_step

    model, batch, _ = setup
    monkeypatch.setattr(router_replay, "uses_transformer_engine", lambda _model: True)
    monkeypatch.setattr(router_replay, "thd_alignment", lambda _config: 16)
    micro = MicroBatchLayout(max_tokens=48, pack=True).plan(batch)[0]
    width = micro.input_ids.shape[1]
    total = (width // 16 + 1) * 16  # e.g. 41 tokens -> 48
    assert width % 16
    targets = []

    def replayed_forward(data_iterator, stage):
        next(data_iterator)
        targets.extend(replay.target_topk_idx.clone() for replay in moe_routers(stage))

    router_replay.replaying_forward_step(replayed_forward)(iter([micro]), model)
    for layer, indices in enumerate(targets):
        assert indices.shape == (total, 2)
        assert torch.equal(indices[:width], micro_batch_routes(micro)[0, :, layer])
        assert torch.equal(indices[width:], torch.tensor([[0, 1]]).expand(total - width, 2))  # experts 0..k-1

    def recorded_forward(data_iterator, stage):
        next(data_iterator)
        for layer, replay in enumerate(moe_routers(stage)):
            replay.record_indices(torch.arange(total * 2).view(total, 2) + 1000 * layer)

    recorded = []
    recording_forward_step(recorded_forward, recorded)(iter([micro]), model)
    routes = recorded[0][1]
    assert routes.shape == (1, width, 2, 2)  # the filler rows are gone
    assert torch.equal(routes[0, :, 1], torch.arange(width * 2).view(width, 2) + 1000)
