"""Every built-in advantage estimator, run through the trainer's data-parallel glue
(``nemo_sspo.parallel.advantage_scope.data_parallel_advantages``) over gloo, equals the float64
reference of the whole step (``tests/unit/advantage_reference.py``; and a step-scope estimator of this
module) for DP 1 and 2, 1 or 2 optimizer
steps per training step and micro-batches of 1, 2 and 4 rows.

One spawn of 3 processes. First in the layout of ``rollout.schedule.placement: separate`` with one rollout
rank: ranks 0 and 1 train (their data-parallel group excludes rank 2), rank 2 only joins the group
creation and then waits, as a rollout rank never enters the trainer's collectives. Then the real
thing: one step of the tiny Llama with ``rollout.schedule.placement: separate`` (training DP 2 + 1 rollout rank),
``advantage.name=batch_std``, 2 optimizer steps and 1-row micro-batches: the advantages of every
update equal the reference of the rewards the rollout rank sent.
"""

import datetime
import random

import pytest
import torch
import torch.distributed as dist

from nemo_sspo.cli import load_config
from nemo_sspo.megatron import destroy_parallel
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.parallel.world_split import split_world
from nemo_sspo.trainer import loop, policy, setup

from nemo_sspo.algorithms.advantage_estimators import (
    DCPO_SMOOTH,
    AdvantageEstimator,
    AdvantageInputs,
    get_advantage_estimator,
    register_advantage_estimator,
)
from nemo_sspo.algorithms.advantages import smooth_group_advantages
from nemo_sspo.parallel.advantage_scope import data_parallel_advantages
from tests.integration._loop_runs import TINY, ParityReward, observe
from tests.unit.advantage_reference import reference_advantages

GROUP, PROMPTS = 2, 8  # 16 rows: 8 per training rank at DP 2
NAMES = ("group", "leave_one_out", "batch_std", "critic", "step_mean")
KEYS = ["p", "q", "p", "r", "s", "q", "t", "p"]  # prompt keys of the 8 groups: p thrice, q twice, across ranks
STEP_MEAN = AdvantageEstimator("step_mean", "step", lambda inputs, stats: inputs.rewards.double() - stats.means[:, 0],
                               row_values=lambda inputs: inputs.rewards.double().unsqueeze(1))
"""A step-scope estimator for this test: r_i minus the mean reward of the whole step (0 for equal groups)."""


def _reference(name, rewards, task, logits, dp, minibatches):
    if name != "step_mean":
        return reference_advantages(name, rewards, GROUP, dp=dp, minibatches=minibatches, task_rewards=task,
                                    value_logits=logits)
    mean = sum(rewards) / len(rewards)
    equal = [max(task[i - i % GROUP:i - i % GROUP + GROUP]) == min(task[i - i % GROUP:i - i % GROUP + GROUP])
             for i in range(len(rewards))]
    return [0.0 if eq else r - mean for r, eq in zip(rewards, equal, strict=True)]


def _step():
    rng = random.Random(3)
    task = [float(rng.random() < 0.5) for _ in range(GROUP * PROMPTS)]
    task[:GROUP] = [0.0] * GROUP  # one zero-variance group
    rewards = [t - 0.25 * rng.random() for t in task]
    logits = [rng.uniform(-1, 1) for _ in range(PROMPTS)]
    return task, rewards, logits


def _inputs(task, rewards, logits, groups: slice) -> AdvantageInputs:
    rows = slice(groups.start * GROUP, groups.stop * GROUP)
    return AdvantageInputs(torch.tensor(rewards[rows]), torch.tensor(task[rows]), GROUP,
                           value_logits=torch.tensor(logits[groups]))


def _advantages(rank, world_size, out_dir):
    pure = _estimators(rank)
    dist.barrier()
    return pure, _separate_step(rank, world_size, out_dir)


def _separate_step(rank, world_size, out_dir):
    """``(rewards of the received rollout, advantages of each update in order)`` on a training rank."""
    tiny = load_hf_checkpoint("tiny-random-llama")
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    split = split_world(store, rank=rank, world_size=world_size, num_rollout_ranks=1,
                        timeout=datetime.timedelta(seconds=60))
    cfg = load_config(overrides=[*TINY, f"trainer.output_dir={out_dir}", "trainer.max_steps=1",
                                 "rollout.samples_per_prompt=4", "parallel.micro_batch_size=1",
                                 "advantage.name=batch_std", "rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1"])
    if split.is_rollout:
        setup.run_rollout_rank(cfg, split, checkpoint=tiny, reward=ParityReward())
        return None
    seen, updates = [], []
    train = policy.train_on_batch

    def recorded_train(model, optimizer, batch, *args, **kwargs):
        updates.append(batch.advantages.clone())
        return train(model, optimizer, batch, *args, **kwargs)

    policy.train_on_batch = recorded_train
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), checkpoint=tiny, split=split)
    observe(trainer, "rollout", lambda got: seen.append(got.versioned.rollout.rewards.tolist()))
    try:
        trainer.fit()
    finally:
        destroy_parallel()
    return seen[0], updates


def _estimators(rank):
    training = dist.new_group([0, 1])  # every rank creates the group, as split_world does
    if rank == 2:
        return None
    register_advantage_estimator(STEP_MEAN)
    task, rewards, logits = _step()
    out = {}
    half = PROMPTS // 2
    for name in NAMES:
        estimator = get_advantage_estimator(name)
        for minibatches in (1, 2):
            # DP 2: this rank's groups; DP 1: the whole step on each process alone (no collective).
            mine = _inputs(task, rewards, logits, slice(rank * half, (rank + 1) * half))
            out[name, 2, minibatches] = data_parallel_advantages(estimator, mine, minibatches=minibatches,
                                                                 dp_group=training, dp_size=2)[0]
            whole = _inputs(task, rewards, logits, slice(0, PROMPTS))
            out[name, 1, minibatches] = data_parallel_advantages(estimator, whole, minibatches=minibatches,
                                                                 dp_group=None, dp_size=1)[0]
    # DCPO's smooth standardisation over two steps (the second reads the first's history), DP 2.
    history = {}
    for step in range(2):
        rows = slice(rank * half * GROUP, (rank + 1) * half * GROUP)
        step_rewards = torch.tensor(rewards[::-1] if step else rewards)[rows]
        inputs = AdvantageInputs(step_rewards, step_rewards, GROUP, prompt_keys=KEYS[rank * half:(rank + 1) * half],
                                 history=history)
        out["dcpo", step], history = data_parallel_advantages(DCPO_SMOOTH, inputs, minibatches=1, dp_group=training,
                                                              dp_size=2)
    out["dcpo", "history"] = history
    dist.barrier(group=training)
    return out


@pytest.mark.slow  # 19 s on 2 idle cores (the trainer step of 3 processes), about 70 s when they are shared
def test_every_builtin_matches_the_reference_for_dp_minibatches_and_micro_batches(run_distributed, tmp_path):
    task, rewards, logits = _step()
    (rank0, step0), (rank1, step1), (rollout_rank, rollout_step) = run_distributed(_advantages, 3, str(tmp_path),
                                                                                   timeout_s=180)
    assert rollout_rank is None and rollout_step is None
    # The separate-placement step: rank d trained on the groups it received; the updates' rows in order.
    step_rewards = step0[0] + step1[0]  # slot order: training rank 0 owns the first prompt group
    want = reference_advantages("batch_std", step_rewards, 4, dp=2, minibatches=2)
    assert len(step0[1]) == len(step1[1]) == 2  # trainer.minibatches_per_step=2 updates of 2 rows per rank
    got = torch.cat([*step0[1], *step1[1]])
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=1e-6)
    group = reference_advantages("group", step_rewards, 4)
    assert not torch.allclose(got, torch.tensor(group, dtype=torch.float32), atol=1e-3), "rewards too uniform"
    rows = GROUP * PROMPTS
    for name in NAMES:
        for dp in (1, 2):
            for minibatches in (1, 2):
                want = torch.tensor(_reference(name, rewards, task, logits, dp, minibatches), dtype=torch.float32)
                if dp == 2:
                    got = torch.cat([rank0[name, 2, minibatches], rank1[name, 2, minibatches]])
                else:
                    got = rank0[name, 1, minibatches]
                    assert torch.equal(got, rank1[name, 1, minibatches])
                assert got.shape == (rows,)
                # Micro-batches are consecutive row blocks of each update: the rows keep their advantage.
                per_rank = rows // dp
                for micro in (1, 2, 4):
                    pieces = [got[r * per_rank:(r + 1) * per_rank][i:i + micro]
                              for r in range(dp) for i in range(0, per_rank, micro)]
                    torch.testing.assert_close(torch.cat(pieces), want, rtol=1e-6, atol=1e-6,
                                               msg=f"{name} dp={dp} minibatches={minibatches} micro={micro}")
    # DCPO: every rank's history equals one process's, and the advantages its (hand-checked, see
    # tests/unit/algorithms/test_advantages.py) smooth_group_advantages over the whole step.
    reference, history = {}, {}
    for step in range(2):
        reference[step], history = smooth_group_advantages(torch.tensor(rewards[::-1] if step else rewards), GROUP,
                                                           KEYS, history)
        assert torch.equal(torch.cat([rank0["dcpo", step], rank1["dcpo", step]]), reference[step])
    assert rank0["dcpo", "history"] == rank1["dcpo", "history"] == history
    assert history["p"].visits == 6  # three groups per step, two steps
    # With two optimizer steps the batch std of DP 2 (rank d's first half per batch) differs from DP 1's,
    # as the optimizer batches hold other responses: the check above is not vacuous.
    assert not torch.allclose(torch.cat([rank0["batch_std", 2, 2], rank1["batch_std", 2, 2]]),
                              rank0["batch_std", 1, 2])
