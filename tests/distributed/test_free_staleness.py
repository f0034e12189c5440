"""Free-running staleness (``rollout.schedule.mode=free``, 1 training rank + 1 rollout rank, gloo).

The trainer is slowed down (0.5 s per update, a test-only wrapper) so that the rollout rank is always
the faster side; then the schedule fixes every rollout's version whatever the timing:

- ``wait`` with k = 1: rollouts 1 and 2 come from version 0 (2 = k + 1 untaken), rollout 3 only after
  step 1's notice, so from version 1 (version 2 needs step 2 done, which waits for the 0.5 s update).
  That is the lock-step schedule of k = 1, so the run must equal the colocated lock-step run of the
  same seed (rewards, losses, gradient norms to 1e-5) and drop nothing.
- ``drop`` with k = 0 keeps up to 2 (k + 1) = 2 rollouts ahead that could still train: rollouts 1, 2
  from version 0; after step 1 (taken 1, rollout 2 is stale for step 2) rollouts 3, 4 from version 1;
  after step 2 (taken 3) rollouts 5, 6 from version 2. Step 1 trains 1; step 2 drops 2 and trains 3;
  step 3 drops 4 and trains 5; rollout 6 is drained at the end. dropped_share = [0, 1/2, 1/2]. The
data position a checkpoint saves is the trained rollout's: 5 x 2 prompts = 10, not 12.

The drop counts are also recomputed from the versions the training rank received (recorded by a
wrapper around ``recv_free_rollout``, not by the trainer's own bookkeeping).
"""

import json
import time

import pytest
import torch

from nemo_sspo.cli import load_config
from nemo_sspo.megatron import destroy_parallel
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.rollouts import collector
from nemo_sspo.trainer.policy import Policy
from tests.distributed._split_world import fit_side, resplit
from tests.integration._loop_runs import TINY, ParityReward, make_trainer

RUN = [*TINY, "rollout.correction.name=token_tis", "optim.lr=0.05", "trainer.max_steps=3"]
KEYS = ("reward/mean", "optim/grad_norm", "loss/policy", "policy/ratio", "rollout/kl_k3_behaviour", "rollout/is_weight")
UPDATE_DELAY_S = 0.5


def _slow_update(self, batch, inner=Policy.update):
    time.sleep(UPDATE_DELAY_S)
    return inner(self, batch)


def _recording_recv(received):
    inner = collector.recv_free_rollout

    def recv(*, group, sources, src=None, what):
        got = inner(group=group, sources=sources, src=src, what=what)
        received.append((got[1], got[2].version))
        return got
    return recv


def _free_run(split, tiny, out_dir, overrides):
    cfg = load_config(overrides=[*RUN, f"trainer.output_dir={out_dir}", "rollout.schedule.placement=separate",
                                 "rollout.schedule.num_ranks=1", "rollout.schedule.mode=free", *overrides])
    received = []
    collector.recv_free_rollout = _recording_recv(received)
    # the data position a checkpoint would save is trainer.problems_drawn
    return fit_side(cfg, split, tiny, ParityReward(),
                    run=lambda trainer: (trainer.fit(), received, trainer.problems_drawn))


def _child(rank, world_size, out_dir):
    tiny = load_hf_checkpoint("tiny-random-llama")
    split = resplit(rank, world_size, 1, 60)
    Policy.update = _slow_update
    recv = collector.recv_free_rollout
    results = {}
    for name, overrides in {"wait": ["rollout.schedule.max_staleness=1", "rollout.schedule.stale_policy=wait"],
                            "drop": ["rollout.schedule.max_staleness=0", "rollout.schedule.stale_policy=drop"]}.items():
        results[name] = _free_run(split, tiny, f"{out_dir}/{name}", overrides)
        collector.recv_free_rollout = recv
    return results


def _drops_from_versions(received, steps, k):
    """Per step, the rollouts received before the one it trains on with lag (step - 1) - version > k."""
    drops, queue = [], list(received)
    for step in range(1, steps + 1):
        dropped = 0
        while step - 1 - queue.pop(0)[1] > k:
            dropped += 1
        drops.append(dropped)
    return drops, queue


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-llama")


def test_free_running_wait_and_drop(run_distributed, monkeypatch, tmp_path, tiny):
    results = run_distributed(_child, 2, str(tmp_path), timeout_s=300)[0]

    history, received, position = results["wait"]
    assert received == [(1, 0), (2, 0), (3, 1)]  # nothing beyond the last step, nothing drained
    assert position == 6  # after rollout 3, of 2 prompts each
    assert [h["rollout/version_lag_mean"] for h in history] == [0.0, 1.0, 1.0]
    assert [h["rollout/version_lag_max"] for h in history] == [0.0, 1.0, 1.0]
    assert [h["rollout/dropped_share"] for h in history] == [0.0, 0.0, 0.0]
    assert history[-1]["rollout/dropped_total"] == 0.0
    threads = torch.get_num_threads()  # the ranks run one intra-op thread (see test_separate_placement.py)
    torch.set_num_threads(1)
    try:
        ref = make_trainer(monkeypatch, tmp_path / "lockstep", ["rollout.correction.name=token_tis", "optim.lr=0.05",
                                                                "trainer.max_steps=3", "rollout.schedule.max_staleness=1"],
                           checkpoint=tiny)
        ref_history = ref.fit()
    finally:
        destroy_parallel()
        torch.set_num_threads(threads)
    for mine, theirs in zip(history, ref_history, strict=True):
        for key in KEYS:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (mine["step"], key)
    for h in history:  # each side's idle time and rate are reported per step
        assert h["timing/train_idle_s"] >= h["timing/generation_s"]
        assert h["throughput/generation_tokens_per_s"] == pytest.approx(
            h["tokens/response"] / h["timing/rollout_generation_s"])
        # One training rank and one rollout rank: the rollout side's rate is per its one GPU, and the run's
        # per-GPU figure divides the step's tokens by both.
        assert h["throughput/generation_tokens_per_s_per_gpu"] == h["throughput/generation_tokens_per_s"]
        assert h["throughput/tokens_per_s_per_gpu"] == pytest.approx(
            (h["tokens/prompt"] + h["tokens/response"]) / h["timing/step_s"] / 2)
    # rollout 3 waits for step 1's update (>= 0.5 s): the rollout rank idled at least that long in step 3
    assert history[2]["timing/rollout_idle_s"] >= UPDATE_DELAY_S

    history, received, position = results["drop"]
    assert received == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2)]
    assert position == 10  # of the trained rollout 5 (2 prompts each), not of the drained rollout 6 (12)
    drops, drained = _drops_from_versions(received, 3, k=0)
    assert drops == [0, 1, 1] and drained == [(6, 2)]
    assert [h["rollout/dropped_share"] for h in history] == [d / (d + 1) for d in drops] == [0.0, 0.5, 0.5]
    assert [h["rollout/dropped_total"] for h in history] == [0.0, 1.0, 2.0]
    assert all(h["rollout/version_lag_max"] == 0.0 for h in history)  # no trained sample older than k = 0
    # the timeline shows the dropped rollouts on the rollout lane
    phases = [json.loads(line) for line in (tmp_path / "drop" / "timeline.jsonl").read_text().splitlines()]
    assert sorted(e["step"] for e in phases if e["phase"] == "dropped") == [2, 3]
    assert (tmp_path / "drop" / "timeline.png").stat().st_size > 0
