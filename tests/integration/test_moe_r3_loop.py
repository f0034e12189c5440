"""Two GRPO steps on the tiny Qwen3-MoE with router replay R3 over gloo: EP 1 x TP 1 (world 2) and
EP 2 x TP 2 with sequence parallelism (world 4).

World 2 = two data-parallel replicas holding all 8 experts of every MoE layer; world 4 = the same
two replicas, each split over TP 2 (sequence parallelism: each TP rank's routers see half of every
row's positions), the experts split over EP 2 (4 per replica) and each expert over TP 2. The
transformers engine records its routes while it generates. Every optimizer step's mini-batch must
carry, at each valid token of each row, exactly the routes the engine recorded for that row (the
loop's path from ``RolloutBatch.routes`` through ``PolicyBatch.from_rollout`` to the update). Engine
and trainer hold the same weights in fp32, so the trainer's own routers agree with the engine's on
every token-layer pair here and the engine/trainer log-prob gap is float rounding, with or without
replay (an engine holding the weights rounded to bf16 already disagrees on 0.5% of the pairs:
``benchmarks/moe_router_replay.py``). The same rollouts (seeded per prompt group) make the EP 2 x
TP 2 + SP steps equal the EP 1 x TP 1 steps (loss, gradient norm, MoE metrics, HF's load-balancing
loss at 0.001 whose router statistics are gathered over TP).
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_sspo.algorithms.batch import pack_tokens
from nemo_sspo.megatron import destroy_parallel, unwrap_model
from tests.integration._loop_runs import make_trainer, record_updates

R3 = ["model=tiny_random_qwen3_moe", "rollout.samples_per_prompt=4", "model.router_replay=r3",
      "model.router_aux_loss_coef=0.001"]
# run name -> (world size, layout overrides)
LAYOUTS = {
    "ep1_tp1": (2, []),
    "ep2_tp2_sp": (4, ["parallel.expert_model_parallel_size=2", "parallel.tensor_model_parallel_size=2",
                       "parallel.sequence_parallel=true"]),
}
# An on-policy mini-batch's loss is a sum of per-token terms of size |A| ~ 1 that cancel (the
# group-normalised advantages sum to 0): measured 6.7e-4 with TP 2 off by 1.0e-7, fp32 rounding of
# those terms in another reduction order (TP 2 splits every matmul's sum), not of the loss's value.
ABS_TOL = {"loss/policy": 1e-6}
COMPARED = ("loss/policy", "optim/grad_norm", "moe/expert_load_max_over_mean", "moe/aux_loss",
            "moe/routing_agreement", "policy/entropy", "policy/ratio")


def _fit(rank, world_size, tmp_dir, name):
    monkeypatch = pytest.MonkeyPatch()
    updates, rollouts = [], []
    record_updates(monkeypatch, updates)
    trainer = make_trainer(monkeypatch, f"{tmp_dir}/{name}", [*R3, *LAYOUTS[name][1]])
    if trainer.sampler is not None:  # the generating rank of each replica (TP rank 0)
        generate = trainer.sampler.collect

        def collect(step):
            rollout = generate(step)
            rollouts.append(rollout.batch)
            return rollout

        trainer.sampler.collect = collect
    try:
        history = trainer.fit()
        return history, rollouts, [batch for batch, _ in updates], unwrap_model(trainer.model).config.sequence_parallel
    finally:
        trainer.close()
        destroy_parallel()


@pytest.fixture(scope="module")
def r3_runs(run_distributed, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("r3"))
    return {name: run_distributed(_fit, world, tmp, name, timeout_s=600) for name, (world, _) in LAYOUTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_r3_steps_train_on_the_engine_routes(r3_runs, name):
    runs = r3_runs[name]
    tp = len(runs) // 2  # two data-parallel replicas; rank tp * d (TP rank 0) generates replica d's rows
    for rank, (history, _, updates, _) in enumerate(runs):
        rollouts = runs[rank - rank % tp][1]
        assert len(rollouts) == 2 and len(updates) == 4  # 2 steps x 2 mini-batches of 2 rows
        for step, rollout in enumerate(rollouts):
            _, lengths = pack_tokens([(rollout.prompt_ids, rollout.prompt_mask),
                                      (rollout.response_ids, rollout.response_mask)], pad_id=0)
            trained = [updates[2 * step], updates[2 * step + 1]]
            for row, length in enumerate(lengths.tolist()):
                batch = trained[row // 2]
                assert torch.equal(batch.routes[row % 2, :length], rollout.routes[row, :length]), (step, row)
        for metrics in history:
            assert metrics["moe/routing_agreement"] == 1.0
            assert metrics["rollout/trainer_logprob_gap_abs"] < 1e-5
            assert metrics["rollout/trainer_logprob_gap_abs_own_routes"] < 1e-5
            assert 1.0 <= metrics["moe/expert_load_max_over_mean"] <= 4.0  # 8 experts, top-2: at most 8 / 2
            assert 0.0 < metrics["moe/aux_loss"] <= 8.0  # E * sum_e f_e P_e <= E * (f_1 + f_2) = 8 at top-2
        assert history[0]["optim/grad_norm"] > 1e-3  # the parity reward varies within step 1's groups


@pytest.mark.slow
def test_ep2_tp2_sequence_parallel_steps_equal_ep1_tp1(r3_runs):
    """EP 2 x TP 2 + SP trains (MoE under TP was refused before) and takes the EP 1 x TP 1 steps.
    World-4 rank 2 * d + t is data-parallel replica d, TP rank t; world-2 rank d is replica d."""
    reference, sharded = r3_runs["ep1_tp1"], r3_runs["ep2_tp2_sp"]
    assert [run[3] for run in sharded] == [True] * 4 and [run[3] for run in reference] == [False] * 2
    for rank, (history, _, updates, _) in enumerate(sharded):
        ref_history, _, ref_updates, _ = reference[rank // 2]
        for batch, ref_batch in zip(updates, ref_updates, strict=True):  # same rows, same engine routes
            assert torch.equal(batch.input_ids, ref_batch.input_ids) and torch.equal(batch.routes, ref_batch.routes)
        off = [(step, key, got[key], want[key])
               for step, (got, want) in enumerate(zip(history, ref_history, strict=True), start=1)
               for key in COMPARED if not math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=ABS_TOL.get(key, 1e-7))]
        assert not off, off
