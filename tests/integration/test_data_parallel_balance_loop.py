"""The trainer balances token-budget mini-batches across data-parallel ranks and the step stays the
single process's: DP=2 over gloo against one process on the same prompt groups (each rank rolls
out its own groups; ``test_dynamic_sampling_loop`` shows the split keeps the same groups)."""

from __future__ import annotations

import math

import pytest

from nemo_sspo.algorithms.micro_batches import balanced_partition
from nemo_sspo.megatron import destroy_parallel
from tests.integration._loop_runs import make_trainer, record_updates

BUDGET = ["rollout.prompts_per_step=4", "trainer.minibatches_per_step=1",
          "parallel.max_tokens_per_micro_batch=160"]


def _first_step(rank, world_size, tmp_dir):
    """Runs in a spawned gloo process: step 1's metrics, the lengths this rank rolled out and the
    lengths of the rows it trained on."""
    monkeypatch = pytest.MonkeyPatch()
    updates = []
    record_updates(monkeypatch, updates)
    trainer = make_trainer(monkeypatch, f"{tmp_dir}/w{world_size}", BUDGET)
    try:
        rolled = []
        inner = trainer.prepare_batch

        def prepare(rollout):
            batch, sums = inner(rollout)
            rolled.extend(batch.lengths.tolist())
            return batch, sums

        trainer.prepare_batch = prepare
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
