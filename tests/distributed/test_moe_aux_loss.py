"""HF's auxiliary load-balancing loss over two data-parallel replicas with EP 2 (world 2, gloo),
against float64 transformers.

The stated rule (``nemo_sspo/megatron/step.py``): the replicas' micro-batches are micro-batches of
the step, so two replicas of 2 rows give the denominator-weighted mean of transformers' loss on each
replica's rows, as gradient accumulation over the same halves does in one process
(``tests/unit/algorithms/test_moe_aux_loss.py``), and not the whole batch's value: expert parallelism moves
tokens between the replicas' experts, but each replica's routers see its own tokens. The
router-weight gradient of the term (summed over the replicas) is transformers' float64 gradient of
the same expression.
"""

from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
from tests.unit.moe_aux_cases import COEF, hf_aux_and_grads, hf_model, megatron_runs, policy_batch, relative_error


def _ep2(rank: int, world_size: int) -> dict:
    """(aux loss, router grads) per coef, 2 rows per replica in one micro-batch."""
    layout = {"replica": MicroBatchLayout(micro_batch_size=2)}
    return {coef: (aux, routers) for (_, coef), (aux, routers, _) in megatron_runs(layout, (COEF, 0.0), ep=2).items()}


def test_ep2_replicas_weight_their_own_losses(run_distributed):
    results = run_distributed(_ep2, 2, timeout_s=300)
    hf, batch = hf_model(), policy_batch()
    whole, _ = hf_aux_and_grads(hf, batch, [slice(0, 4)], [1.0])
    # DAPO's token-mean denominator: the response tokens of each replica's rows, 4 + 2 and 5 + 3.
    halves, halves_grads = hf_aux_and_grads(hf, batch, [slice(0, 2), slice(2, 4)], [6.0, 8.0])
    assert abs(halves - whole) > 1e-3 * whole  # the rule's value is not the whole batch's
    for rank_results in results:
        aux, with_aux = rank_results[COEF]
        _, without = rank_results[0.0]
        assert abs(aux - halves) < 1e-5 * halves, (aux, halves)
        for grad_with, grad_without, hf_grad in zip(with_aux, without, halves_grads, strict=True):
            assert relative_error(grad_with - grad_without, hf_grad) < 1e-4
