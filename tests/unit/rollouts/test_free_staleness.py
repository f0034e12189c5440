"""Free-running staleness without processes: the rollout rank's generation bound (FreeQueue) driven
by a simulated trainer, the acceptance rule, the per-side metrics, per-response versions of a step
stacked from several rollouts, and the settings refused at load."""

import pytest
import torch

from nemo_sspo.cli import load_config
from nemo_sspo.rollout import RolloutBatch
from nemo_sspo.rollouts.slots import stack_rollouts
from nemo_sspo.rollouts.records import Rollout
from nemo_sspo.rollouts.records import VersionedRollout
from nemo_sspo.rollouts.staleness import FreeQueue, dropped_sums, is_fresh, rollout_idle_s, version_lag_sums


def _simulate(k, policy, last, per_notice):
    """Runs the schedule with a trainer that takes rollouts in order (dropping stale ones) and a rollout
    rank that generates up to ``per_notice`` rollouts between two notices (as many as allowed when
    None). Returns the versions of the rollouts sent, the drops per step and the rollouts left over.

    Fails if the trainer would wait for a rollout the rollout rank refuses to start (a deadlock).
    """
    queue, sent, drops = FreeQueue(k, policy, last, version=0, sent=0), [], []

    def generate(limit):
        made = 0
        while queue.may_generate() and (limit is None or made < limit):
            queue.record(queue.version)
            sent.append(queue.version)
            made += 1

    generate(per_notice)
    taken = 0
    for step in range(1, last + 1):
        dropped = 0
        while True:
            while taken >= len(sent):  # the trainer waits: the rollout rank must be allowed to go on
                assert queue.may_generate(), (step, sent)
                generate(1)
            version = sent[taken]
            taken += 1
            if is_fresh(version, step, k):
                break
            dropped += 1
        drops.append(dropped)
        if step < last:
            queue.take_notice(step, taken)
            generate(per_notice)
    return sent, drops, len(sent) - taken


def test_wait_with_a_fast_rollout_rank_is_the_lock_step_schedule():
    # k = 2, 5 steps: rollouts 1..3 from version 0 (k + 1 untaken), then one per notice: 4 from version 1,
    # 5 from version 2, none beyond the last step. Lags 0, 1, 2, 2, 2 as lock-step; nothing dropped.
    sent, drops, left = _simulate(k=2, policy="wait", last=5, per_notice=None)
    assert sent == [0, 0, 0, 1, 2] and drops == [0] * 5 and left == 0
    assert [step - 1 - v for step, v in enumerate(sent, 1)] == [0, 1, 2, 2, 2]


def test_wait_with_a_slow_rollout_rank_is_fresher_than_lock_step():
    # One rollout per notice: rollout n comes from version n - 1 (on-policy), k never binds.
    sent, drops, left = _simulate(k=1, policy="wait", last=4, per_notice=1)
    assert sent == [0, 1, 2, 3] and drops == [0] * 4 and left == 0


def test_drop_with_a_fast_rollout_rank_drops_every_other_rollout_at_k0():
    # Bound 2 (k + 1) = 2 rollouts that can still train. Versions 0, 0 | 1, 1 | 2, 2: steps 2 and 3
    # each drop the older one (lag 1 > 0) and train the next; the last is left over (drained).
    sent, drops, left = _simulate(k=0, policy="drop", last=3, per_notice=None)
    assert sent == [0, 0, 1, 1, 2, 2] and drops == [0, 1, 1] and left == 1


def test_drop_counts_only_rollouts_that_can_still_train_and_never_starves_the_trainer():
    # k = 1, bound 4. Rollouts 1..4 from version 0. Notice 1 (taken 1): 2..4 can still train step 2
    # (0 >= 1 - 1), so one more: 5 from version 1. Notice 2 (taken 2): 3, 4 (version 0) are stale for
    # step 3 and no longer count, only 5 does: 6, 7, 8 from version 2. Step 3 drops 3 and 4, trains 5.
    # Notice 3 (taken 5): 6..8 count, one more: 9 from version 3. Step 4 trains 6; 7..9 are left over.
    sent, drops, left = _simulate(k=1, policy="drop", last=4, per_notice=None)
    assert sent == [0, 0, 0, 0, 1, 2, 2, 2, 3] and drops == [0, 0, 2, 0] and left == 3
    for k in (0, 1, 2):
        for per_notice in (None, 1, 2):
            _simulate(k=k, policy="drop", last=6, per_notice=per_notice)


def test_is_fresh_at_the_bound():
    # step 4 starts from version 3: version 1 has lag 2
    assert is_fresh(1, 4, 2) and not is_fresh(1, 4, 1) and is_fresh(3, 4, 0)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy='skip' must be 'wait' or 'drop'"):
        FreeQueue(1, "skip", 3, 0, 0)


def test_dropped_share_and_rollout_idle():
    # 2 dropped before the trained one: 2 of 3 received; with 2 rollout ranks, 1 dropped of 3 received
    assert dropped_sums(2)["rollout/dropped_share"].as_tensor().tolist() == [2.0, 3.0]
    assert dropped_sums(1, 2)["rollout/dropped_share"].as_tensor().tolist() == [1.0, 3.0]
    # gaps: 10 - 9 = 1 before the first window, 15 - 12 = 3 before the second
    assert rollout_idle_s([(10.0, 12.0), (15.0, 16.0)], 9.0) == 4.0
    assert rollout_idle_s([(10.0, 12.0), (15.0, 16.0)], None) == 3.0


SEPARATE = ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1"]


@pytest.mark.parametrize("overrides, match", [
    ([*SEPARATE, "rollout.schedule.mode=async"],
     r"rollout\.schedule\.mode='async' is unknown; valid: lockstep, free"),
    ([*SEPARATE, "rollout.schedule.mode=free", "rollout.schedule.stale_policy=skip"],
     r"rollout\.schedule\.stale_policy='skip' is unknown; valid: wait, drop"),
    (["rollout.schedule.mode=free"], r"mode=free needs rollout\.schedule\.placement=separate .* or "
     r"rollout\.schedule\.mode=lockstep"),
    ([*SEPARATE, "rollout.schedule.stale_policy=drop"], r"stale_policy='drop' needs rollout\.schedule\.mode=free"),
])
def test_bad_free_running_settings_fail_at_load(monkeypatch, overrides, match):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=match):
        load_config(overrides=["model=tiny_random", *overrides])


def test_free_running_loads(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(overrides=["model=tiny_random", *SEPARATE, "rollout.schedule.mode=free",
                                 "rollout.schedule.stale_policy=drop"])
    assert (cfg.rollout.schedule.mode, cfg.rollout.schedule.stale_policy) == ("free", "drop")
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = load_config(overrides=["model=tiny_random", "rollout.schedule.placement=separate", "rollout.schedule.num_ranks=2",
                                 "rollout.schedule.mode=free", "rollout.prompts_per_step=2"])
    assert cfg.rollout.schedule.num_ranks == 2


def test_wait_bounds_each_rank_by_what_the_remaining_steps_can_train():
    # R = 2, k = 3, 2 steps: the run trains 4 rollouts, so before any notice a rank may keep at most
    # min(k + 1, R (last - version)) = min(4, 4) = 4; after notice 1 (1 step left) at most 2 untaken.
    queue = FreeQueue(3, "wait", 2, version=0, sent=0, num_ranks=2)
    while queue.may_generate():
        queue.record(queue.version)
    assert queue.sent == 4
    assert queue.take_notice(1, taken=3) == 1  # rollout 4 untaken
    assert queue.may_generate()  # 1 < min(4, 2)
    queue.record(1)
    assert not queue.may_generate()  # 2 untaken that can still train
    # a resumed rank numbers on from its position
    resumed = FreeQueue(1, "wait", 9, version=5, sent=7, num_ranks=2)
    assert resumed.record(5) == 8


def test_responses_stacked_from_two_versions_keep_their_own_lags():
    # Rollout A (version 2, 2 responses) and B (version 3, 2 responses) stacked for step 5 (starting
    # from version 4): lags 2, 2, 1, 1 -> mean 1.5, max 2; the stack's version is the oldest.
    parts = []
    for version, ids in ((2, [[5, 6], [7, 0]]), (3, [[8, 9], [1, 2]])):
        batch = RolloutBatch(prompt_ids=torch.tensor([[1], [1]]), prompt_mask=torch.ones(2, 1, dtype=torch.bool),
                             response_ids=torch.tensor(ids), response_mask=torch.tensor(ids) > 0,
                             truncated=torch.zeros(2, dtype=torch.bool), response_texts=["a", "b"],
                             rollout_logprobs=torch.zeros(2, 2))
        rollout = Rollout(batch=batch, task_rewards=torch.zeros(2), rewards=torch.zeros(2), rounds=1,
                          generated_groups=1, prompt_keys=["00" * 16])
        parts.append(VersionedRollout(rollout, version=version, problems_drawn=0, generated=(version, version + 1)))
    stacked = stack_rollouts(parts, pad_id=0, problems_drawn=7)
    assert stacked.version == 2 and stacked.sample_versions.tolist() == [2, 2, 3, 3]
    assert stacked.generated == (2, 4) and stacked.problems_drawn == 7
    lags = version_lag_sums(stacked, 5)
    assert lags["rollout/version_lag_mean"].as_tensor().tolist() == [6.0, 4.0]
    assert lags["rollout/version_lag_max"].as_tensor().tolist()[0] == 2.0
    # one version for all: no per-response versions kept
    assert stack_rollouts(parts[:1], pad_id=0, problems_drawn=0).sample_versions is None
