"""Two GRPO steps on the tiny Qwen3-MoE with expert parallelism 2 and router replay R3 over gloo.

World 2 = two data-parallel replicas, each holding 4 of the 8 experts of every MoE layer; the
transformers engine records its routes while it generates. Every optimizer step's mini-batch must
carry, at each valid token of each row, exactly the routes the engine recorded for that row (the
loop's path from ``RolloutBatch.routes`` through ``PolicyBatch.from_rollout`` to the update). Engine
and trainer hold the same weights in fp32, so the trainer's own routers agree with the engine's on
every token-layer pair here and the engine/trainer log-prob gap is float rounding, with or without
replay (an engine holding the weights rounded to bf16 already disagrees on 0.5% of the pairs:
``benchmarks/moe_router_replay.py``).
"""

from __future__ import annotations

import pytest
import torch

from nemo_sspo.algorithms.batch import pack_tokens
from nemo_sspo.megatron import destroy_parallel
from tests.integration._loop_runs import make_trainer, record_updates

R3 = ["model=tiny_random_qwen3_moe", "rollout.samples_per_prompt=4", "model.router_replay=r3",
      "parallel.expert_model_parallel_size=2"]


def _fit(rank, world_size, tmp_dir):
    monkeypatch = pytest.MonkeyPatch()
    updates, rollouts = [], []
    record_updates(monkeypatch, updates)
    trainer = make_trainer(monkeypatch, f"{tmp_dir}/r3", R3)
    generate = trainer.sampler.collect

    def collect(step):
        rollout = generate(step)
        rollouts.append(rollout.batch)
        return rollout

    trainer.sampler.collect = collect
    try:
        history = trainer.fit()
        return history, rollouts, [batch for batch, _ in updates]
    finally:
        trainer.close()
        destroy_parallel()


@pytest.mark.slow
def test_ep2_r3_steps_train_on_the_engine_routes(run_distributed, tmp_path):
    for history, rollouts, updates in run_distributed(_fit, 2, str(tmp_path), timeout_s=400):
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
        assert history[0]["optim/grad_norm"] > 1e-3  # the parity reward varies within step 1's groups
