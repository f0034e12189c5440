"""Router replay on Megatron's MoE routers (megatron-core's RouterReplay), single process.

References are independent of Megatron: transformers' ``Qwen3MoeForCausalLM`` in float64, whose
router's top-k indices are read with a forward hook (recording), or whose router is replaced by
HF's own weighting formula applied to given indices (replay: softmax over all experts, the given
experts' probabilities renormalised, as ``norm_topk_prob=True``). Model B is model A with its
router weights redrawn, so B's own routes differ from A's on most tokens: replaying A's routes in B
must give the forced-route reference, and B's plain routing must not.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from nemo_sspo.megatron import forward_logits
from nemo_sspo.megatron.router_replay import (
    clear_routes,
    record_routes,
    recorded_routes,
    replay_routes,
    routing_agreement,
)
from nemo_sspo.algorithms.batch import route_dtype
from tests.unit.mapping_cases import TINY_MOE, VOCAB, megatron_copy, relative_error

SEQ, BATCH, EXPERTS, TOP_K = 7, 2, TINY_MOE["num_experts"], TINY_MOE["num_experts_per_tok"]


def _hf_model(seed: int, router_seed: int) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_MOE)).eval()
    generator = torch.Generator().manual_seed(router_seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    return model.double()


def _hf_routes(model: Qwen3MoeForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """[B, S, L, k] top-k indices of transformers' own routers (forward hooks on ``mlp.gate``)."""
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: seen.append(out[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return torch.stack([indices.view(*ids.shape, -1) for indices in seen], dim=2)


def _forced_logits(model: Qwen3MoeForCausalLM, ids: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """transformers' logits with every router forced to ``routes`` [B, S, L, k] (HF's weighting)."""
    originals = []
    for index, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        chosen = routes[:, :, index].reshape(-1, routes.shape[-1]).long()  # HF rows are batch-first; gather: int64

        def forced(hidden, gate=gate, chosen=chosen):
            logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            weights = torch.softmax(logits, dim=-1).gather(1, chosen)
            return logits, weights / weights.sum(dim=-1, keepdim=True), chosen

        originals.append(gate.forward)
        gate.forward = forced
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        for layer, original in zip(model.model.layers, originals, strict=True):
            layer.mlp.gate.forward = original


def _megatron(hf_model: Qwen3MoeForCausalLM):
    return megatron_copy(hf_model.config, {k: v.float() for k, v in hf_model.state_dict().items()})


def test_recorded_routes_are_transformers_routes_and_replay_forces_them(parallel_1):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    hf_a, hf_b = _hf_model(0, router_seed=1), _hf_model(0, router_seed=2)  # B: A with other routers
    model_a, model_b = _megatron(hf_a), _megatron(hf_b)

    record_routes(model_a)
    with torch.no_grad():
        forward_logits(model_a, ids, positions)
    routes_a = recorded_routes(model_a, BATCH, SEQ)
    clear_routes(model_a)
    assert routes_a.shape == (BATCH, SEQ, 2, TOP_K)
    # 2 * 7 tokens x 2 layers, every top-2 set as transformers' float64 router chose it
    assert routing_agreement(routes_a, _hf_routes(hf_a, ids), mask).tolist() == [28.0, 28.0]
    matching, counted = routing_agreement(_hf_routes(hf_b, ids), routes_a, mask).tolist()
    assert matching / counted < 0.5  # B's own routers disagree with A on most (token, layer) pairs

    expected = _forced_logits(hf_b, ids, routes_a)
    with torch.no_grad():
        plain = forward_logits(model_b, ids, positions)[..., :VOCAB]
        replay_routes(model_b, routes_a)
        replayed = forward_logits(model_b, ids, positions)[..., :VOCAB]
        clear_routes(model_b)
        after = forward_logits(model_b, ids, positions)[..., :VOCAB]
    assert relative_error(replayed, expected) < 1e-5
    assert relative_error(plain, expected) > 1e-3  # without replay, B's own routes give other logits
    assert torch.equal(after, plain)  # clear_routes restores plain routing
    # Routes are held in int16 (8 experts); replaying them widened to int64 gives the same logits.
    assert routes_a.dtype == torch.int16
    with torch.no_grad():
        replay_routes(model_b, routes_a.long())
        replayed_int64 = forward_logits(model_b, ids, positions)[..., :VOCAB]
        clear_routes(model_b)
    assert torch.equal(replayed_int64, replayed)


@pytest.mark.parametrize(("experts", "dtype"), [
    (1, torch.int16), (8, torch.int16), (128, torch.int16),
    (32768, torch.int16),  # ids 0 .. 32767 = int16 max
    (32769, torch.int32),  # id 32768 does not fit
])
def test_route_dtype_is_the_smallest_that_holds_every_expert_id(experts, dtype):
    assert route_dtype(experts) == dtype
    ids = torch.tensor([0, experts - 1])
    assert torch.equal(ids.to(dtype).long(), ids)  # the largest id survives the round trip


def test_route_dtype_refuses_no_experts():
    with pytest.raises(ValueError, match="num_experts=0 must be >= 1"):
        route_dtype(0)


def test_replay_refuses_routes_of_another_layer_count(parallel_1):
    model = _megatron(_hf_model(0, router_seed=1))
    with pytest.raises(ValueError, match=r"routes must be \[B, S, L=2, k\], got \(2, 7, 3, 2\)"):
        replay_routes(model, torch.zeros(2, 7, 3, 2, dtype=torch.long))


def test_routing_agreement_counts_matching_sets_on_masked_tokens():
    # 1 row, 3 tokens, 1 layer, top-2; token 0: {1, 2} vs {2, 1} match (order ignored), token 1:
    # {0, 3} vs {0, 2} differ, token 2 masked out -> 1 match of 2 counted pairs
    routes = torch.tensor([[[[1, 2]], [[0, 3]], [[4, 5]]]])
    other = torch.tensor([[[[2, 1]], [[0, 2]], [[6, 7]]]])
    mask = torch.tensor([[True, True, False]])
    assert routing_agreement(routes, other, mask).tolist() == [1.0, 2.0]


LENGTHS = [7, 4, 6, 3]  # valid tokens per row of a right-padded [4, 7] batch


def _policy_batch():
    from nemo_sspo.algorithms.batch import PolicyBatch

    rows = len(LENGTHS)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(9))
    positions = torch.arange(SEQ).expand(rows, SEQ)
    lengths = torch.tensor(LENGTHS)
    valid = positions < lengths[:, None]
    ids = torch.where(valid, ids, 0)
    targets = torch.cat([ids[:, 1:], torch.zeros(rows, 1, dtype=torch.long)], dim=1)
    loss_mask = (positions >= 1) & (positions < lengths[:, None] - 1)  # responses after a 2-token prompt
    zeros = torch.zeros(rows, SEQ)
    return PolicyBatch(input_ids=ids, position_ids=positions.contiguous(), targets=targets, loss_mask=loss_mask,
                       segment_ids=torch.where(loss_mask, 0, -1), old_logprobs=zeros, old_entropy=zeros,
                       advantages=torch.ones(rows), lengths=lengths)


@pytest.mark.parametrize("layout", [dict(micro_batch_size=2), dict(max_tokens=14), dict(max_tokens=14, pack=True)],
                         ids=["fixed", "token-budget", "packed"])
def test_r2_routes_stay_with_their_rows_and_training_forwards_replay_them(parallel_1, layout):
    from dataclasses import replace

    from nemo_sspo.algorithms.losses import GRPOLossConfig, make_policy_loss
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import compute_old_logprobs, forward_logprobs

    spec = LossSpec(loss=make_policy_loss("grpo", GRPOLossConfig(aggregation="token-mean")), tp_group=None,
                    vocab_start=0, vocab_size=VOCAB, temperature=1.0, max_response_length=SEQ,
                    output_chunk_size=None)
    plan = MicroBatchLayout(**layout)
    hf_a, hf_b = _hf_model(0, router_seed=1), _hf_model(0, router_seed=2)
    batch = compute_old_logprobs(_megatron(hf_a), _policy_batch(), spec, plan, dp_group=None, record_routes=True)
    assert batch.routes.shape == (len(LENGTHS), SEQ, 2, TOP_K)
    with torch.no_grad():
        model_b = _megatron(hf_b)
        replayed, _ = forward_logprobs(model_b, batch, spec, plan, dp_group=None)
        plain, _ = forward_logprobs(model_b, replace(batch, routes=None), spec, plan, dp_group=None)
    for row, length in enumerate(LENGTHS):
        # Each row alone through transformers (float64): A's own routes are what was recorded at
        # the row's valid tokens, wherever the layout put the row (sorted by length, packed).
        ids = batch.input_ids[row : row + 1, :length]
        routes = batch.routes[row : row + 1, :length]
        valid = torch.ones(1, length, dtype=torch.bool)
        assert routing_agreement(routes, _hf_routes(hf_a, ids), valid).tolist() == [2.0 * length] * 2
        # B replaying A's routes = transformers' B forced to them, at every response token
        logprobs = torch.log_softmax(_forced_logits(hf_b, ids, routes), dim=-1)
        mask = batch.loss_mask[row, :length]
        expected = logprobs[0].gather(1, batch.targets[row, :length, None])[:, 0][mask]
        assert (replayed[row, :length][mask].double() - expected).abs().max() < 1e-5, row
        assert batch.old_logprobs[row][~batch.loss_mask[row]].abs().max() == 0
    assert (plain - replayed).abs().max() > 1e-3  # B's own routers: other log-probs


def test_expert_load_counts_valid_tokens_of_the_worst_layer(parallel_1):
    from nemo_sspo.megatron import get_parallel_groups
    from nemo_sspo.megatron.router_replay import expert_load_pair

    # 2 rows x 3 tokens, 2 layers, top-2, 4 experts; row 1 has 1 valid token (the rest is padding).
    # Layer 0, valid tokens {0,1} {0,2} {0,3} | {1,2}: counts [3, 2, 2, 1], mean 2 -> 1.5.
    # Layer 1: {0,1} {2,3} {0,1} | {2,3}: counts [2, 2, 2, 2] -> 1.0. Worst layer: 1.5.
    routes = torch.tensor([[[[0, 1], [0, 1]], [[0, 2], [2, 3]], [[0, 3], [0, 1]]],
                           [[[1, 2], [2, 3]], [[3, 3], [3, 3]], [[3, 3], [3, 3]]]])
    pair = expert_load_pair(routes, torch.tensor([3, 1]), 4, dp_group=get_parallel_groups().dp_group)
    assert (pair.kind, float(pair.total), float(pair.count)) == ("max", 1.5, 1.0)
