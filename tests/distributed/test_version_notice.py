"""The free-running refit protocol between training rank 0 and a rollout rank (world 2, gloo, no model).

Rank 0 posts a version notice and a two-bucket weight broadcast without waiting; the rollout rank
finds no notice before it is posted (a non-blocking poll returns None), then takes the notice, joins
the broadcast a second later (the posted broadcast is still running meanwhile) and must receive the
buckets bit for bit; then the stop notice. Then rank 0 exits while the rollout rank waits for a
notice: its poll fails with an error naming training rank 0.
"""

import pytest
import time

import torch

from nemo_sspo.parallel.version_notice import STOP, Notice, NoticeListener, post_notice
from nemo_sspo.parallel.weight_broadcast import encode_weight_buckets, post_weight_broadcast, receive_weight_buckets
from tests.distributed._split_world import resplit

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)

HOLD_S = 1.0  # each side's pause, so the other's state at that moment is known


def _buckets():
    return [{"a": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
            {"b": torch.tensor([1.5, -2.0, 3.25, 0.0], dtype=torch.bfloat16), "c": torch.tensor([7], dtype=torch.int64)}]


def _child(rank, world_size):
    split = resplit(rank, world_size, 1, 10)
    if rank == 0:
        time.sleep(HOLD_S)  # the rollout rank polls meanwhile
        tensor, work = post_notice(Notice(3, (5,)), group=split.pairs[0])
        pending = post_weight_broadcast(encode_weight_buckets(_buckets(), torch.device("cpu")), group=split.pairs[0],
                                        receivers=[1])
        running = not pending.works[-1][0].is_completed()  # the rollout rank joins HOLD_S after the notice
        work.wait()
        stats = pending.wait()
        tensor, work = post_notice(Notice(STOP, (6,)), group=split.pairs[0])
        work.wait()
        return running, stats.buckets, stats.bytes  # then this process exits: the rollout rank's next poll fails
    listener = NoticeListener(split.pairs[0], num_rollout_ranks=1)
    early = listener.poll(block=False)
    notice = listener.poll(block=True)
    time.sleep(HOLD_S)
    received = [{name: t.clone() for name, t in bucket.items()} for bucket in receive_weight_buckets(group=split.pairs[0])]
    stop = listener.poll(block=True)
    try:
        listener.poll(block=True)
        error = "no error"
    except RuntimeError as err:
        error = str(err)
    return early, notice, received, stop, error


def test_notice_then_non_blocking_broadcast_then_stop_and_a_dead_trainer_is_named(run_distributed):
    (running, buckets, sent), (early, notice, received, stop, error) = run_distributed(_child, 2, timeout_s=120)
    assert early is None  # polled before rank 0 posted anything
    assert notice == Notice(version=3, taken=(5,)) and stop == Notice(version=STOP, taken=(6,))
    assert running  # the broadcast was still waiting for the rollout rank when rank 0 went on
    # a: 6 float32 = 24 bytes; b: 4 bf16 = 8 bytes, c: 1 int64 = 8 bytes
    assert (buckets, sent) == (2, 40)
    expected = _buckets()
    assert [list(bucket) for bucket in received] == [["a"], ["b", "c"]]
    for got, want in zip(received, expected, strict=True):
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert "training rank 0 sent no new policy version (it died or hung past the timeout)" in error
