"""DAPO in the loop: dynamic sampling never trains on a zero-variance group while enough exist, says
clearly (warning + metrics) when the round limit is hit, and keeps the same groups for DP=2 as for
one process; overlong reward shaping (tiny random Llama, stub rewards)."""

import hashlib
import logging
import random

import pytest
import torch

from nemo_sspo.megatron import destroy_parallel
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.rollouts.sampling import generation_seed
from tests.integration._loop_runs import (OddAnswerReward, ZeroReward, generate, make_trainer, on_policy_loss,
                                         observe, record_rollouts, record_updates, run)

DYNAMIC = ["loss=dapo", "rollout.prompts_per_step=4", "trainer.minibatches_per_step=1",
           "rollout.sampling.max_sampling_rounds=6"]


@pytest.fixture(scope="module")
def checkpoint():
    return load_hf_checkpoint("tiny-random-llama")


def _record_rollouts(store):
    def capture(trainer):
        record_rollouts(trainer, store)

    return capture


def test_batch_never_holds_a_zero_variance_group_when_enough_exist(checkpoint, monkeypatch, tmp_path):
    # Problems with an even answer score 0 for every response; the sampler must replace them.
    rollouts, updates = [], []
    record_updates(monkeypatch, updates)
    history = run(monkeypatch, tmp_path, DYNAMIC, checkpoint=checkpoint, reward=OddAnswerReward,
                  capture=_record_rollouts(rollouts))
    refilled = 0
    for rollout, record in zip(rollouts, history):
        groups = rollout.task_rewards.reshape(-1, 2)
        assert groups.shape[0] == 4 and bool((groups.amax(1) != groups.amin(1)).all())
        assert record["advantages/zero_variance_group_frac"] == 0.0
        # kept / generated: every generated group with variance is kept, the others were refilled
        assert record["rollout/kept_group_frac"] == pytest.approx(4 / rollout.generated_groups)
        refilled += rollout.generated_groups - 4
    # One update per step, on-policy: every token's loss is -A_i, token-mean (DAPO) by hand.
    for (batch, _), record in zip(updates, history):
        assert record["loss/policy"] == pytest.approx(on_policy_loss(batch, "token-mean", 8)[0], rel=1e-5, abs=1e-6)
    assert refilled > 0  # the stream did hold even answers: the refill path ran
    assert max(r["rollout/sampling_rounds"] for r in history) > 1


def test_round_limit_warns_and_trains_on_the_full_batch(checkpoint, monkeypatch, tmp_path, caplog):
    rollouts = []
    with caplog.at_level(logging.WARNING, logger="nemo_sspo.rollouts.sampling"):
        history = run(monkeypatch, tmp_path, [*DYNAMIC, "rollout.sampling.max_sampling_rounds=2"], checkpoint=checkpoint,
                      reward=ZeroReward, capture=_record_rollouts(rollouts))
    messages = [r.getMessage() for r in caplog.records]
    assert any("found 0 of 4 prompt groups with reward variance after 2 rounds "
               "(rollout.sampling.max_sampling_rounds=2); training on the full batch" in m for m in messages), messages
    for rollout, record in zip(rollouts, history):
        assert rollout.batch.response_ids.shape[0] == 8  # every rank keeps P/dp x G rows
        assert rollout.generated_groups == 8  # 4 slots x 2 rounds
        assert record["rollout/sampling_rounds"] == 2.0 and record["rollout/kept_group_frac"] == 0.0
        assert record["advantages/zero_variance_group_frac"] == 1.0
        # Every advantage is 0: loss and gradient exactly 0, and the one update per step is on-policy.
        assert record["loss/policy"] == 0.0 and record["optim/grad_norm"] == 0.0
        assert record["policy/ratio"] == 1.0


def test_overlong_shaping_penalises_responses_at_the_cap(checkpoint, monkeypatch, tmp_path):
    # The tiny random model never stops early: every response has L_max = 8 tokens, so DAPO eq. 13
    # with L_cache = 4 gives the full penalty, ((8 - 4) - 8) / 4 = -1, times overlong_penalty 0.5.
    rollouts = []
    (record,) = run(monkeypatch, tmp_path, ["trainer.max_steps=1", "reward.overlong_buffer_len=4",
                                            "reward.overlong_penalty=0.5"], checkpoint=checkpoint,
                    capture=_record_rollouts(rollouts))
    (rollout,) = rollouts
    assert bool((rollout.batch.response_mask.sum(1) == 8).all())
    assert torch.equal(rollout.rewards, rollout.task_rewards - 0.5)
    assert record["reward/shaped_mean"] == pytest.approx(record["reward/mean"] - 0.5)


def _cut_responses_to(lengths):
    """Wraps the rollout engine so that response b of each group ends after ``lengths[b]`` tokens
    (the tiny random model never emits EOS by itself)."""
    def capture(trainer):
        engine = trainer.sampler.engine
        inner = engine.generate

        def generate(prompts, *, seed):
            batch = inner(prompts, seed=seed)
            keep = torch.arange(batch.response_mask.shape[1]) < torch.tensor(lengths).unsqueeze(1)
            batch.response_mask &= keep
            batch.rollout_logprobs *= keep
            batch.truncated[:] = False
            return batch

        engine.generate = generate

    return capture


def test_shaping_gives_an_all_wrong_group_past_the_round_limit_advantage_0(checkpoint, monkeypatch, tmp_path,
                                                                          caplog):
    # One all-wrong group of lengths 3, 4, 5, 6 (L_max 8, L_cache 4): shaped rewards [0, 0, -0.25,
    # -0.5] vary, the task rewards do not. The log says such groups have advantage 0; before the
    # fix they got [0.9045, 0.9045, -0.3015, -1.5076] and zero_variance_group_frac read 0.
    advantages, rollouts = [], []

    def capture(trainer):
        _cut_responses_to([3, 4, 5, 6])(trainer)
        _record_rollouts(rollouts)(trainer)
        observe(trainer, "advantages", lambda data: advantages.append(data[1]))

    overrides = [*DYNAMIC, "rollout.prompts_per_step=1", "rollout.samples_per_prompt=4", "trainer.max_steps=1",
                 "rollout.sampling.max_sampling_rounds=2", "reward.overlong_buffer_len=4"]
    with caplog.at_level(logging.WARNING, logger="nemo_sspo.rollouts.sampling"):
        (record,) = run(monkeypatch, tmp_path, overrides, checkpoint=checkpoint, reward=ZeroReward,
                        capture=capture)
    assert any("the other 1 groups have advantage 0" in r.getMessage() for r in caplog.records)
    (rollout,) = rollouts
    assert rollout.rewards.tolist() == [0.0, 0.0, -0.25, -0.5]
    assert advantages[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert record["advantages/zero_variance_group_frac"] == 1.0
    assert record["loss/policy"] == 0.0  # every token's advantage is 0


def test_generation_seed_depends_on_step_round_and_slot_only(monkeypatch):
    def by_hand(seed, step, round_, slot):  # blake2b-64 of "seed/step/round/slot", top bit cleared
        digest = hashlib.blake2b(f"{seed}/{step}/{round_}/{slot}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    tuples = [(1234, 1, 0, 3), (1234, 2, 0, 3), (1234, 1, 1, 3), (1234, 1, 0, 0), (0, 7, 5, 2)]
    assert [generation_seed(*t) for t in tuples] == [by_hand(*t) for t in tuples]
    assert generation_seed(1234, 1, 0, 3) == 0x53BC7E784CCDA036  # pinned: a new hash would change every run's samples
    seeds = {generation_seed(1234, step, r, k) for step in (1, 2) for r in range(3) for k in range(4)}
    assert len(seeds) == 24 and all(0 <= s < 2**63 for s in seeds)
    # Nothing but the four numbers: a rank of a 2-way data-parallel split and a different torch/Python
    # random state give the same seeds.
    expected = [by_hand(*t) for t in tuples]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    torch.manual_seed(99)
    random.seed(99)
    assert [generation_seed(*t) for t in tuples] == expected


def _dp_rollouts(rank, world_size, tmp_dir):
    """Runs in a spawned gloo process: the first two steps' rollouts of this rank."""
    import pytest as _pytest

    monkeypatch = _pytest.MonkeyPatch()
    trainer = make_trainer(monkeypatch, f"{tmp_dir}/w{world_size}", DYNAMIC, reward=OddAnswerReward)
    try:
        out = []
        for step in (1, 2):
            rollout = generate(trainer, step)
            out.append((rollout.batch.response_texts, rollout.task_rewards, rollout.rounds))
        return out
    finally:
        trainer.close()
        destroy_parallel()


@pytest.mark.slow
def test_data_parallel_split_keeps_the_same_groups(run_distributed, tmp_path):
    single = run_distributed(_dp_rollouts, 1, str(tmp_path))[0]
    split = run_distributed(_dp_rollouts, 2, str(tmp_path))
    assert max(single[step][2] for step in range(2)) > 1  # slots were refilled
    for step in range(2):
        texts = split[0][step][0] + split[1][step][0]
        assert texts == single[step][0]
        assert torch.equal(torch.cat([split[0][step][1], split[1][step][1]]), single[step][1])
        assert split[0][step][2] == split[1][step][2] == single[step][2]  # same number of rounds
