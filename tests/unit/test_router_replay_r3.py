"""Router replay R3 in one process: the trainer runs the experts the rollout engine chose.

The engine is transformers' ``generate`` on the tiny random Qwen3-MoE whose router weights were
redrawn (std 0.5, as the checkpoint's own), so it routes most tokens elsewhere than the trainer's
Megatron model, which holds the original weights. Which experts Megatron's routers actually used is
read at the router (a spy on megatron-core's ``RouterReplay.get_replay_topk``, which returns the
indices the dispatcher gets), undoing Megatron's sequence-first flattening (router row ``s * R + r``
of an ``[R, S_in]`` input) here, independently of ``router_replay.py``.
"""

from dataclasses import replace

import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

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
from nemo_sspo.megatron.router_replay import routing_agreement, write_micro_batch_routes
from nemo_sspo.megatron.step import LossSpec
from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.rollout import HFRolloutEngine

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


def _used_routes(model, batch, spec, layout):
    """``(logprobs [B, S], routes [B, S, L, k])``: a forward of ``batch`` and the experts its routers used."""
    calls = []
    real = RouterReplay.get_replay_topk

    def spy(self, *args, **kwargs):
        probs, indices = real(self, *args, **kwargs)
        calls.append(indices.detach().clone())
        return probs, indices

    used = []
    real_step = training.policy_forward_step

    def spying_step(*args, **kwargs):
        inner = real_step(*args, **kwargs)

        def step(data_iterator, model_chunk):
            micro = next(data_iterator)
            calls.clear()
            out = inner(iter([micro]), model_chunk)
            rows, width = micro.input_ids.shape  # the router saw row s * rows + r of each layer
            used.append((micro, torch.stack([c.view(width, rows, -1).transpose(0, 1) for c in calls], dim=2)))
            return out

        return step

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RouterReplay, "get_replay_topk", spy)
        patch.setattr(training, "policy_forward_step", spying_step)
        logprobs, _ = training.forward_logprobs(model, batch, spec, layout, dp_group=None)
    routes = torch.zeros(*batch.input_ids.shape, *used[0][1].shape[2:], dtype=torch.long)
    for micro, micro_routes in used:
        write_micro_batch_routes(routes, micro, micro_routes)
    return logprobs, routes


def _gap(batch, logprobs) -> float:
    return float((batch.rollout_logprobs - logprobs)[batch.loss_mask].abs().mean())


@pytest.mark.parametrize("layout", [dict(micro_batch_size=2), dict(max_tokens=48), dict(max_tokens=48, pack=True)],
                         ids=["fixed", "token-budget", "packed"])
def test_r3_trainer_uses_the_engine_experts_at_every_token(setup, layout):
    model, batch, spec = setup
    plan = MicroBatchLayout(**layout)
    valid = torch.arange(batch.input_ids.shape[1])[None, :] < batch.lengths[:, None]
    replayed, replayed_routes = _used_routes(model, batch, spec, plan)
    own, own_routes = _used_routes(model, replace(batch, routes=None), spec, plan)
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
