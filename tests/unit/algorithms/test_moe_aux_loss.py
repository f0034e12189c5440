"""HF's auxiliary load-balancing loss in Megatron's training forward, and its stated contract exception.

References are transformers' own (``tests/unit/moe_aux_cases.py``): ``load_balancing_loss_func``
of ``modeling_qwen3_moe`` (called on plain logits, and on the router logits of a float64
``Qwen3MoeForCausalLM`` with its attention mask), with the gradient of the coefficient-weighted loss
taken by autograd in float64.

The contract (``nemo_sspo/megatron/step.py``): each micro-batch ``m`` adds
``coef * aux_m * denominator_m``; the step's term is the denominator-weighted mean of the
micro-batches' own HF losses. One micro-batch (padded rows, or one packed row) gives HF's value on
the whole batch; two micro-batches give the weighted mean of HF's value on each half, which is not
the whole batch's; with ``coef = 0`` the gradients do not depend on the split. TP 2 and EP 2
(two data-parallel replicas) run in ``tests/distributed/test_moe_aux_loss.py``.
"""

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from nemo_sspo.algorithms.load_balancing import load_balancing_loss
from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
from tests.unit.moe_aux_cases import (
    COEF,
    EXPERTS,
    TOP_K,
    hf_aux_and_grads,
    hf_model,
    megatron_runs,
    policy_batch,
    relative_error,
)


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


@pytest.fixture(scope="module")
def runs():
    """(aux metric, router grads, all grads) per (layout, coef) on one Megatron fp32 model."""
    layouts = {"one": MicroBatchLayout(micro_batch_size=4), "two": MicroBatchLayout(micro_batch_size=2),
               "packed": MicroBatchLayout(max_tokens=64, pack=True)}
    return hf_model(), policy_batch(), megatron_runs(layouts, (COEF, 0.0))


def test_row_lengths_are_prompt_plus_response(runs):
    _, batch, _ = runs
    # HF's attention mask below counts prompt + response tokens: 3+4, 2+2, 4+5, 2+3.
    assert batch.row_lengths().tolist() == [7, 4, 9, 5]


@pytest.mark.parametrize("layout", ["one", "packed"])
def test_one_micro_batch_gives_transformers_loss_and_gradient(runs, layout):
    hf, batch, results = runs
    expected, hf_grads = hf_aux_and_grads(hf, batch, [slice(0, 4)], [1.0])
    aux, router_with, _ = results[layout, COEF]
    _, router_without, _ = results[layout, 0.0]
    assert aux == pytest.approx(expected, rel=1e-5)
    # The aux term's gradient is the difference of the runs with and without it (same forward).
    for with_aux, without, reference in zip(router_with, router_without, hf_grads, strict=True):
        assert relative_error(with_aux - without, reference) < 1e-4


def test_two_micro_batches_weight_each_halfs_own_loss_by_its_denominator(runs):
    hf, batch, results = runs
    # DAPO's token-mean denominator: the response tokens of each half, 4 + 2 = 6 and 5 + 3 = 8.
    expected, hf_grads = hf_aux_and_grads(hf, batch, [slice(0, 2), slice(2, 4)], [6.0, 8.0])
    whole, _ = hf_aux_and_grads(hf, batch, [slice(0, 4)], [1.0])
    aux, router_with, _ = results["two", COEF]
    _, router_without, _ = results["two", 0.0]
    assert aux == pytest.approx(expected, rel=1e-5)
    assert abs(expected - whole) > 100 * 1e-5 * whole  # the split changes the value, as stated
    for with_aux, without, reference in zip(router_with, router_without, hf_grads, strict=True):
        assert relative_error(with_aux - without, reference) < 1e-4


def test_without_aux_loss_the_split_does_not_change_gradients(runs):
    _, _, results = runs
    assert results["one", 0.0][0] is None  # no aux term, no metric
    reference = results["one", 0.0][2]
    for layout in ("two", "packed"):
        for grad, expected in zip(results[layout, 0.0][2], reference, strict=True):
            assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-7)
