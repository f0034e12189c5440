"""The trainer balances token-budget mini-batches across data-parallel ranks (before the old
log-prob pass and the update) and the step stays the single process's: DP=2 over gloo against one process on the same prompt groups (each rank rolls
out its own groups; ``test_dynamic_sampling_loop`` shows the split keeps the same groups)."""

from __future__ import annotations

import math

import pytest

from nemo_sspo.algorithms.micro_batches import balanced_partition
from nemo_sspo.megatron import destroy_parallel
from tests.integration._loop_runs import make_trainer, observe, record_updates

BUDGET = ["rollout.prompts_per_step=4", "trainer.minibatches_per_step=1",
          "parallel.max_tokens_per_micro_batch=160", "rollout.correction.name=token_tis", "rollout.correction.cap=1.5"]


def _first_step(rank, world_size, tmp_dir):
    """Runs in a spawned gloo process: step 1's metrics, the lengths (prompt + response) this rank
    rolled out and those of the rows it scored and trained on."""
    monkeypatch = pytest.MonkeyPatch()
    updates = []
    record_updates(monkeypatch, updates)
    trainer = make_trainer(monkeypatch, f"{tmp_dir}/w{world_size}", BUDGET)
    try:
        rolled = []

        def record(got):
            rb = got.versioned.rollout.batch
            rolled.extend((rb.prompt_mask.sum(1) + rb.response_mask.sum(1)).tolist())

        observe(trainer, "rollout", record)
        metrics = trainer.train_step(1)
        ((trained, _),) = updates
        return metrics, rolled, trained.lengths.tolist()
    finally:
        trainer.close()
        destroy_parallel()


@pytest.mark.slow
def test_balanced_data_parallel_step_equals_one_process(run_distributed, tmp_path):
    (single,) = run_distributed(_first_step, 1, str(tmp_path))
    split = run_distributed(_first_step, 2, str(tmp_path))
    rolled = split[0][1] + split[1][1]
    assert rolled == single[1]  # same groups, rank 0's first
    parts = balanced_partition(rolled, 2)
    for rank in range(2):
        # rows arrive by source rank then row, i.e. in the order of the global row index
        assert split[rank][2] == [rolled[i] for i in parts[rank]]
    # Step 1 is on policy (every ratio 1), so the loss is -mean(A) = 0 by construction; the gradient
    # norm and the SSPO bounds' mean over the segments depend on every row reaching the loss once.
    for key in ("optim/grad_norm", "policy/b_high", "policy/segments_per_response"):
        for rank in range(2):
            assert math.isclose(split[rank][0][key], single[0][key], rel_tol=1e-5, abs_tol=1e-7), key
    # The transformers engine and the trainer agree to float rounding, so the engine-vs-trainer
    # gap is ~0 and every correction weight ~1, but only if each row reads its own engine log-probs after
    # moving (PolicyBatch.rollout_logprobs travels with it; another row's would be off by O(1)).
    for rank in range(2):
        assert split[rank][0]["rollout/trainer_logprob_gap_abs"] < 1e-4
        assert abs(split[rank][0]["rollout/is_weight"] - 1.0) < 1e-4
