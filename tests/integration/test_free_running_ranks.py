"""Free-running over two rollout ranks (``rollout.schedule.mode=free``, torchrun: 1 training rank
+ 2 rollout ranks, gloo; ``_free_ranks_worker.py``): each rollout holds one of the step's two prompt
groups, and a step trains the first two fresh rollouts to arrive, from whichever rank.

- ``wait`` with k = 0, 4 steps: a rank may keep one rollout untaken, so rank j's rollout t comes from
  version t - 1 and step t trains both ranks' rollout t (lag 0, nothing dropped) whatever the arrival
  order. Resumed from its step-2 checkpoint, which keeps each rank's position (2 rollouts received, 2
  problems drawn), it must equal its own uninterrupted run at steps 3 and 4. The order of a step's two
  rollouts may differ between the runs: with one mini-batch the update sums the two groups'
  gradients, so only the float summation order of the metrics can differ (rel 1e-5).
- ``drop`` with k = 0 and a slow trainer: each rank runs up to two rollouts ahead and stale ones are
  dropped. The drops, the dropped share and the version lags are recomputed from the receipts in
  arrival order; every trained sample is within k; each rank numbers its own rollouts 1, 2, ...
- partial rollouts (``wait``, k = 1) with a slow engine: some responses are continued after a refit
  (sampled by two versions); every response's token versions only grow, a rollout's version is its
  oldest token's, and each step's ``rollout/partial_share`` and lags equal those recomputed from the
  receipts' token versions, none older than k.
"""

import json

import pytest

from tests.integration._launch import torchrun_worker

KEYS = ("reward/mean", "optim/grad_norm", "loss/policy", "policy/ratio", "rollout/kl_k3_behaviour")


def _replay(received, steps, k, per_step=2):
    """Per step: the drops and the versions trained, taking rollouts in arrival order as the rule says."""
    queue, drops, trained = list(received), [], []
    for step in range(1, steps + 1):
        dropped, versions = 0, []
        while len(versions) < per_step:
            _, _, version = queue.pop(0)
            if step - 1 - version <= k:
                versions.append(version)
            else:
                dropped += 1
        drops.append(dropped)
        trained.append(versions)
    return drops, trained


@pytest.mark.slow
def test_two_free_running_rollout_ranks_bound_resume_and_drop(tmp_path):
    torchrun_worker("tests.integration._free_ranks_worker", str(tmp_path), nproc=3, timeout_s=420)
    results = json.loads((tmp_path / "result.json").read_text())

    history, received = results["full"]["history"], [tuple(r) for r in results["full"]["received"]]
    received = [r[:3] for r in received]
    for step in range(1, 5):  # both ranks' rollout t from version t - 1, in whatever order they arrived
        assert sorted(received[2 * (step - 1):2 * step]) == [(1, step, step - 1), (2, step, step - 1)]
    assert len(received) == 8  # nothing beyond the last step, nothing drained
    assert all(h["rollout/version_lag_max"] == 0.0 and h["rollout/dropped_share"] == 0.0 for h in history)
    state = json.loads((tmp_path / "full" / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["rollout_positions"] == [[2, 2], [2, 2]]  # 2 rollouts of 1 problem each, per rank
    resumed = results["resumed"]
    assert [h["step"] for h in resumed["history"]] == [3, 4]
    assert sorted(tuple(r[:3]) for r in resumed["received"]) == [(src, n, n - 1) for src in (1, 2) for n in (3, 4)]
    for mine, theirs in zip(resumed["history"], history[2:], strict=True):
        for key in KEYS:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (mine["step"], key)

    history, received = results["drop"]["history"], [tuple(r[:3]) for r in results["drop"]["received"]]
    drops, trained = _replay(received, 4, k=0)  # what is left was drained after the stop
    assert [h["rollout/dropped_share"] for h in history] == pytest.approx([d / (d + 2) for d in drops])
    assert [h["rollout/dropped_total"] for h in history] == [float(sum(drops[:s])) for s in range(1, 5)]
    for step, (h, versions) in enumerate(zip(history, trained, strict=True), 1):
        lags = [step - 1 - v for v in versions]
        assert h["rollout/version_lag_mean"] == pytest.approx(sum(lags) / len(lags))
        assert h["rollout/version_lag_max"] == max(lags) == 0  # no trained sample older than k = 0
    for src in (1, 2):
        numbers = [n for s, n, _ in received if s == src]
        assert numbers == list(range(1, len(numbers) + 1))

    history, receipts = results["partial"]["history"], results["partial"]["received"]
    trained, queue = [], list(receipts)
    for step in range(1, 4):  # the trained rollouts of each step, in arrival order (k = 1)
        taken = []
        while len(taken) < 2:
            receipt = queue.pop(0)
            if step - 1 - receipt[2] <= 1:
                taken.append(receipt)
        trained.append(taken)
    for src, number, version, oldest, newest in receipts:
        assert version == min(oldest) and all(o <= n for o, n in zip(oldest, newest, strict=True)), (src, number)
    for step, (h, taken) in enumerate(zip(history, trained, strict=True), 1):
        oldest = [o for receipt in taken for o in receipt[3]]
        spans = sum(n > o for receipt in taken for o, n in zip(receipt[3], receipt[4], strict=True))
        assert h["rollout/partial_share"] == pytest.approx(spans / len(oldest))
        assert h["rollout/version_lag_mean"] == pytest.approx(sum(step - 1 - o for o in oldest) / len(oldest))
        assert h["rollout/version_lag_max"] == max(step - 1 - o for o in oldest) <= 1
    assert sum(h["rollout/partial_share"] for h in history) > 0  # responses were continued across a refit
