"""The lock-step separate rollout source alone: one training rank with :class:`LockStepSource` and a
stand-in rollout rank that speaks the rollout side's protocol by hand (world 2, gloo, no model).

The stand-in takes the start (steps done, its position, receiving ranks), sends a two-group
rollout for step 1 and takes the weight broadcast; the source must return that rollout as sent (ids,
rewards, version, window), report the broadcast's rate, and deliver the weights bit for bit.
"""

from types import SimpleNamespace

import pytest
import torch

from nemo_sspo.parallel.weight_broadcast import receive_weight_buckets
from nemo_sspo.rollout import RolloutBatch
from nemo_sspo.rollouts.codec import _START_TAG, _recv, send_rollout
from nemo_sspo.rollouts.records import Rollout
from nemo_sspo.rollouts import LockStepSource
from nemo_sspo.rollouts.records import VersionedRollout
from tests.distributed._split_world import resplit

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)

WEIGHTS = [{"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, {"b": torch.tensor([0.5, -1.5])}]


def _rollout() -> VersionedRollout:
    batch = RolloutBatch(prompt_ids=torch.tensor([[3, 4], [3, 4]]), prompt_mask=torch.ones(2, 2, dtype=torch.bool),
                         response_ids=torch.tensor([[5, 6, 7], [8, 9, 0]]),
                         response_mask=torch.tensor([[True, True, True], [True, True, False]]),
                         truncated=torch.tensor([True, False]), response_texts=["abc", "de"],
                         rollout_logprobs=torch.tensor([[-0.5, -1.0, -1.5], [-0.25, -0.75, 0.0]]))
    rewards = torch.tensor([1.0, 0.0])
    rollout = Rollout(batch=batch, task_rewards=rewards, rewards=rewards, rounds=1, generated_groups=1,
                      prompt_keys=["ab" * 16])
    return VersionedRollout(rollout, version=0, problems_drawn=1, generated=(100.0, 101.5))


def _child(rank, world_size):
    split = resplit(rank, world_size, 1, 30)
    if split.is_rollout:  # the stand-in rollout rank
        start = _recv(torch.zeros(4, dtype=torch.int64), 0, split.bridge, _START_TAG).tolist()
        replicas = _recv(torch.zeros(start[3], dtype=torch.int64), 0, split.bridge, _START_TAG).tolist()
        sent = send_rollout(_rollout(), dst=replicas[0], group=split.bridge, tag=1)
        for work in sent.works:
            work.wait()
        received = [{k: v.clone() for k, v in bucket.items()} for bucket in receive_weight_buckets(group=split.refit)]
        return start, replicas, received
    groups = type("Groups", (), dict(dp_rank=0, dp_size=1, mp_rank=0, mp_size=1, mp_src_rank=0, mp_group=None))()
    source = LockStepSource(groups, split, SimpleNamespace(buckets=lambda: iter(WEIGHTS)), max_staleness=0,
                            prompts_per_step=1, pad_id=0)
    source.start(0, 0)
    got = source.next_rollout(1)
    refit = source.after_update(1)
    return got, refit


def test_lock_step_source_receives_the_rollout_and_broadcasts_the_weights(run_distributed):
    (got, refit), (start, replicas, received) = run_distributed(_child, 2, timeout_s=120)
    # fresh run: no steps done, position (0 received, 0 drawn), one replica received by rank 0
    assert start == [0, 0, 0, 1] and replicas == [0]
    sent = _rollout()
    mine, theirs = got.versioned.rollout, sent.rollout
    assert torch.equal(mine.batch.response_ids, theirs.batch.response_ids)
    assert torch.equal(mine.batch.rollout_logprobs, theirs.batch.rollout_logprobs)
    assert mine.batch.response_texts == ["abc", "de"] and torch.equal(mine.rewards, theirs.rewards)
    assert (got.versioned.version, got.versioned.problems_drawn) == (0, 1)
    assert got.versioned.generated == (100.0, 101.5) and got.dropped == []
    assert refit.seconds_per_gb > 0 and refit.wait_s == 0.0
    assert [list(b) for b in received] == [["w"], ["b"]]
    assert all(torch.equal(r[k], w[k]) for r, w in zip(received, WEIGHTS, strict=True) for k in w)
