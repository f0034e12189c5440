"""The rollout codec's transports over real gloo groups (3 ranks): :func:`broadcast_rollout` over the
default group, a subgroup and a group of one, and the bridge's point-to-point sends (by source and
any-source); every received rollout must equal the one built in the parent, field by field.
"""

from __future__ import annotations

import datetime
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from nemo_sspo.rollouts.codec import _ROLLOUT_TAG, broadcast_rollout, recv_free_rollout, recv_rollout, send_rollout
from nemo_sspo.rollouts.records import Rollout, VersionedRollout
from nemo_sspo.rollouts.source import StepRollout
from tests.unit._rollout_values import assert_same, build

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)


def _rollout() -> Rollout:
    """Every field set; prompt ids a non-contiguous view (as ``slot_rows`` cuts them)."""
    rollout = build(Rollout, present=True, seed=1)
    wide = torch.arange(40, dtype=torch.int64).reshape(4, 10)
    return replace(rollout, batch=replace(rollout.batch, prompt_ids=wide[1:3, 2:7]))


def _versioned(seed: int) -> VersionedRollout:
    return build(VersionedRollout, present=seed % 2 == 0, seed=seed)


def _child(rank, world_size):
    results = {}
    results["world"] = broadcast_rollout(_rollout() if rank == 1 else None, cls=Rollout, src=1)
    pair = dist.new_group([0, 2])
    alone = dist.new_group([1])
    if rank != 1:
        step = build(StepRollout, present=True, seed=2) if rank == 2 else None
        results["pair"] = broadcast_rollout(step, cls=StepRollout, src=2, group=pair)
    else:
        sent = _versioned(3)
        results["alone_is_sent"] = broadcast_rollout(sent, cls=VersionedRollout, src=1, group=alone) is sent
    store = dist.distributed_c10d._get_default_store()
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("codec-test-bridge", store), rank, world_size,
                                   datetime.timedelta(seconds=60))
    if rank == 0:
        results["p2p"] = recv_rollout(src=2, group=bridge, tag=4)
        free = [recv_free_rollout(group=bridge, sources=[1, 2], what="a test rollout") for _ in range(2)]
        results["free"] = sorted(free, key=lambda got: got[0])
    else:
        pending = [send_rollout(_versioned(4), dst=0, group=bridge, tag=4)] if rank == 2 else []
        pending.append(send_rollout(_versioned(10 + rank), dst=0, group=bridge, tag=20 + rank,
                                    header_tag=_ROLLOUT_TAG))
        for sent in pending:
            for work in sent.works:
                work.wait()
    dist.barrier()
    return results


def test_broadcasts_and_bridge_sends_deliver_the_rollout_sent(run_distributed):
    first, second, third = run_distributed(_child, 3, timeout_s=120)
    for got in (first, second, third):  # the source (rank 1) returns what it sent
        assert_same(got["world"], _rollout())
    for got in (first, third):
        assert_same(got["pair"], build(StepRollout, present=True, seed=2))
    assert second["alone_is_sent"] is True
    assert_same(first["p2p"], _versioned(4))
    # any-source: each rollout rank's rollout, numbered by its parts' tag 20 + rank
    assert [(src, number) for src, number, _ in first["free"]] == [(1, 21), (2, 22)]
    for src, _, rollout in first["free"]:
        assert_same(rollout, _versioned(10 + src))
