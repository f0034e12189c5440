"""HF's auxiliary load-balancing loss in Megatron's training forward, and its stated contract exception.

References are transformers' own: ``load_balancing_loss_func`` of ``modeling_qwen3_moe`` (called
on plain logits, and on the router logits of a float64 ``Qwen3MoeForCausalLM`` with its attention
mask), with the gradient of the coefficient-weighted loss taken by autograd in float64.

The contract (``nemo_sspo/megatron/step.py``): each micro-batch ``m`` adds
``coef * aux_m * denominator_m``; the step's term is the denominator-weighted mean of the
micro-batches' own HF losses. One micro-batch (padded rows, or one packed row) gives HF's value on
the whole batch; two micro-batches give the weighted mean of HF's value on each half, which is not
the whole batch's; with ``coef = 0`` the gradients do not depend on the split.
"""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from nemo_sspo.algorithms.batch import pack_rollouts
from nemo_sspo.algorithms.load_balancing import load_balancing_loss
from nemo_sspo.algorithms.losses import DAPOLossConfig, make_policy_loss
from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
from nemo_sspo.megatron import (
    build_policy_model,
    destroy_parallel,
    initialize_parallel,
    load_hf_into_megatron,
    vocab_shard,
)
from nemo_sspo.megatron.step import LossSpec
from nemo_sspo.megatron.training import compute_gradients, compute_old_logprobs, wrap_for_training
from nemo_sspo.metrics import summarize_metric_pairs
from nemo_sspo.models import split_expert_weights

VOCAB, EXPERTS, TOP_K, LAYERS = 100, 8, 2, 2
PROMPT_LENGTHS = [3, 2, 4, 2]
RESPONSE_LENGTHS = [4, 2, 5, 3]
ADVANTAGES = [1.0, -0.5, 0.7, -1.2]
COEF = 0.5


def test_load_balancing_loss_by_hand_and_against_transformers():
    # By hand: L = 1, E = 2, k = 1, tokens 0 and 1 valid, token 2 padding. Logits give
    # p = [0.5, 0.5] (token 0, expert 0 chosen) and p = [e/(1+e), 1/(1+e)] (token 1, expert 0):
    # f = [2/2, 0] = [1, 0]; P_0 = (0.5 + e/(1+e)) / 2; aux = E * f_0 * P_0 = 0.5 + e/(1+e).
    logits = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [-5.0, 5.0]]], dtype=torch.float64)
    chosen = torch.tensor([[[True, False], [True, False], [False, True]]])
    mask = torch.tensor([True, True, False])
    e = torch.e
    assert load_balancing_loss(logits, chosen, mask).item() == pytest.approx(0.5 + e / (1 + e), rel=1e-6)
    # Random logits, 3 layers, 8 experts, top-2, a [2, 5] attention mask with padding: transformers'
    # function takes per-layer [B*S, E] logits and the [B, S] mask; ours the stacked logits, the
    # top-2 one-hot and the flat mask.
    generator = torch.Generator().manual_seed(0)
    gate_logits = tuple(torch.randn(10, EXPERTS, generator=generator, dtype=torch.float64) for _ in range(3))
    attention = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    stacked = torch.stack(gate_logits)
    top = torch.zeros_like(stacked, dtype=torch.bool).scatter_(-1, stacked.topk(TOP_K, dim=-1).indices, True)
    expected = load_balancing_loss_func(gate_logits, EXPERTS, TOP_K, attention)
    assert load_balancing_loss(stacked, top, attention.reshape(-1).bool()).item() == pytest.approx(
        expected.item(), rel=1e-6)
    assert load_balancing_loss(stacked, top, torch.zeros(10, dtype=torch.bool)).item() == 0.0


def _hf_model() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, tie_word_embeddings=False,
        max_position_embeddings=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)  # routes that depend on the token
    model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    return model.double()


def _batch():
    generator = torch.Generator().manual_seed(1)
    p_max, t_max = max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    prompt_ids = torch.zeros(4, p_max, dtype=torch.long)
    response_ids = torch.zeros(4, t_max, dtype=torch.long)
    for b, (p, t) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        prompt_ids[b, p_max - p:] = torch.randint(1, VOCAB, (p,), generator=generator)
        response_ids[b, :t] = torch.randint(1, VOCAB, (t,), generator=generator)
    prompt_mask = torch.arange(p_max)[None, :] >= (p_max - torch.tensor(PROMPT_LENGTHS))[:, None]
    response_mask = torch.arange(t_max)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    segments = torch.where(response_mask, 0, -1)
    return pack_rollouts(prompt_ids, prompt_mask, response_ids, response_mask, segments,
                         torch.tensor(ADVANTAGES), pad_id=0)


def _hf_aux_and_grads(hf: Qwen3MoeForCausalLM, batch, rows: list[slice], weights: list[float]):
    """sum_m w_m * aux_m / sum_m w_m over row blocks (float64), and its gradient on each router weight."""
    hf.zero_grad()
    total = 0.0
    for block, weight in zip(rows, weights):
        ids = batch.input_ids[block]
        attention = (torch.arange(ids.shape[1])[None, :] < torch.tensor(
            [p + t for p, t in zip(PROMPT_LENGTHS[block], RESPONSE_LENGTHS[block])])[:, None]).long()
        out = hf(ids, attention_mask=attention, output_router_logits=True)
        total = total + weight * load_balancing_loss_func(out.router_logits, EXPERTS, TOP_K, attention)
    total = total / sum(weights)
    (COEF * total).backward()
    return total.item(), [layer.mlp.gate.weight.grad.clone() for layer in hf.model.layers]


def _router_grads(ddp):
    return [param.main_grad.double().clone() for name, param in ddp.module.named_parameters()
            if name.endswith("mlp.router.weight")]


@pytest.fixture(scope="module")
def runs():
    """(aux metric, router grads, all grads) per (layout, coef) on one Megatron fp32 model."""
    torch.set_num_threads(1)
    hf = _hf_model()
    batch = _batch()
    initialize_parallel(tp_size=1, pp_size=1, seed=0)
    try:
        model = build_policy_model(hf.config)
        load_hf_into_megatron(model, split_expert_weights({k: v.float() for k, v in hf.state_dict().items()}),
                              hf.config)
        ddp, _ = wrap_for_training(model, lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                                   adam_eps=1e-8, clip_grad=0.0)
        vocab_start, vocab_size = vocab_shard(model)
        layouts = {"one": MicroBatchLayout(micro_batch_size=4), "two": MicroBatchLayout(micro_batch_size=2),
                   "packed": MicroBatchLayout(max_tokens=64, pack=True)}
        results = {}
        for coef in (COEF, 0.0):
            spec = LossSpec(loss=make_policy_loss("dapo", DAPOLossConfig()), tp_group=None,
                            vocab_start=vocab_start, vocab_size=vocab_size, temperature=1.0,
                            max_response_length=8, output_chunk_size=16, router_aux_loss_coef=coef)
            for name, layout in layouts.items():
                scored = compute_old_logprobs(ddp, batch, spec, layout, dp_group=None)
                sums = compute_gradients(ddp, scored, spec, layout, dp_group=None)
                metrics = summarize_metric_pairs(sums)
                grads = [p.main_grad.double().clone() for p in ddp.module.parameters()]
                results[name, coef] = (metrics.get("moe/aux_loss"), _router_grads(ddp), grads)
    finally:
        destroy_parallel()
    return hf, batch, results


def _close(actual, expected, rtol):
    return float((actual - expected).abs().max() / expected.abs().max()) < rtol


def test_row_lengths_are_prompt_plus_response(runs):
    _, batch, _ = runs
    # HF's attention mask below counts prompt + response tokens: 3+4, 2+2, 4+5, 2+3.
    assert batch.row_lengths().tolist() == [7, 4, 9, 5]


@pytest.mark.parametrize("layout", ["one", "packed"])
def test_one_micro_batch_gives_transformers_loss_and_gradient(runs, layout):
    hf, batch, results = runs
    expected, hf_grads = _hf_aux_and_grads(hf, batch, [slice(0, 4)], [1.0])
    aux, router_with, _ = results[layout, COEF]
    _, router_without, _ = results[layout, 0.0]
    assert aux == pytest.approx(expected, rel=1e-5)
    # The aux term's gradient is the difference of the runs with and without it (same forward).
    for with_aux, without, reference in zip(router_with, router_without, hf_grads, strict=True):
        assert _close(with_aux - without, reference, 1e-4)


def test_two_micro_batches_weight_each_halfs_own_loss_by_its_denominator(runs):
    hf, batch, results = runs
    # DAPO's token-mean denominator: the response tokens of each half, 4 + 2 = 6 and 5 + 3 = 8.
    expected, hf_grads = _hf_aux_and_grads(hf, batch, [slice(0, 2), slice(2, 4)], [6.0, 8.0])
    whole, _ = _hf_aux_and_grads(hf, batch, [slice(0, 4)], [1.0])
    aux, router_with, _ = results["two", COEF]
    _, router_without, _ = results["two", 0.0]
    assert aux == pytest.approx(expected, rel=1e-5)
    assert abs(expected - whole) > 100 * 1e-5 * whole  # the split changes the value, as stated
    for with_aux, without, reference in zip(router_with, router_without, hf_grads, strict=True):
        assert _close(with_aux - without, reference, 1e-4)


def test_without_aux_loss_the_split_does_not_change_gradients(runs):
    _, _, results = runs
    assert results["one", 0.0][0] is None  # no aux term, no metric
    reference = results["one", 0.0][2]
    for layout in ("two", "packed"):
        for grad, expected in zip(results[layout, 0.0][2], reference, strict=True):
            assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-7)
