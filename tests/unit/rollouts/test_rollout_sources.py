"""The colocated rollout source alone, with a fake engine and generator, and the separate sources'
idle-time arithmetic, against schedules and sums worked out by hand."""

from types import SimpleNamespace

import pytest
import torch

from nemo_sspo.rollouts import ColocatedSource, FreeRunningSource, LockStepSource, RefitOutcome, StepRollout
from nemo_sspo.rollouts.records import Piece, VersionedRollout


class _Engine:
    def __init__(self) -> None:
        self.loaded, self.sleeps = [], 0

    def load_weight_buckets(self, buckets) -> None:
        self.loaded.append([dict(bucket) for bucket in buckets])

    def sleep(self) -> None:
        self.sleeps += 1


def _colocated(k: int, engine):
    generated = []  # (step, version) in the order generated

    def generate(step, version):
        generated.append((step, version))
        rollout = SimpleNamespace(rewards=torch.zeros(4), batch=SimpleNamespace(token_versions=None), step=step)  # 4 rows
        return VersionedRollout(rollout, version=version, problems_drawn=2 * step, generated=(step, step + 0.5))

    buckets = [{"w": torch.ones(2)}, {"b": torch.zeros(1)}]
    source = ColocatedSource(SimpleNamespace(produce=generate), SimpleNamespace(buckets=lambda: iter(buckets)), engine,
                             max_staleness=k, last_step=3, verify_refit=False)
    return source, generated


def test_colocated_lock_step_schedule_and_refit_by_hand():
    # k = 1 over 3 steps: step 1 generates steps 1 and 2 from version 0; step 2 generates step 3 from
    # version 1 (the weights after step 1); step 3 generates nothing (beyond the last step).
    engine = _Engine()
    source, generated = _colocated(1, engine)
    source.start(0, 0)
    assert engine.loaded == []  # a fresh engine holds the initial weights already
    trained = []
    for step in (1, 2, 3):
        got = source.next_rollout(step)
        trained.append((got.versioned.rollout.step, got.versioned.version))
        assert got.dropped == []
        # no host copy colocated; the engine loaded 2 + 1 fp32 values (12 bytes)
        assert source.after_update(step) == RefitOutcome(None, 0.0, bytes_to_host=0, bytes=12)
        if step == 2:  # lag (2 - 1) - 0 = 1 for each of the 4 responses
            figures = source.figures(step, got, 0.25, RefitOutcome())
            assert figures.values == {} and figures.wait_phase is None
            assert figures.windows == [("training ranks", "generation", (2, 2.5))]
            assert float(figures.pairs["rollout/version_lag_mean"].total) == 4.0
            assert float(figures.pairs["rollout/version_lag_mean"].count) == 4.0
    assert generated == [(1, 0), (2, 0), (3, 1)]
    assert trained == [(1, 0), (2, 0), (3, 1)]
    assert engine.sleeps == 3
    assert len(engine.loaded) == 3 and torch.equal(engine.loaded[0][0]["w"], torch.ones(2))


def test_colocated_resume_refits_and_k0_reports_no_lag():
    engine = _Engine()
    source, generated = _colocated(0, engine)
    source.start(2, 4)  # resumed after step 2: the engine takes the restored weights first
    assert len(engine.loaded) == 1
    got = source.next_rollout(3)
    assert generated == [(3, 2)] and got.versioned.version == 2
    figures = source.figures(3, got, 0.1, RefitOutcome())
    assert figures.pairs == {} and figures.values == {}


def test_colocated_off_the_generating_rank_runs_the_export_and_loads_nothing():
    source, _ = _colocated(0, None)
    exported = []
    source.exporter = SimpleNamespace(buckets=lambda: (exported.append(name) or {} for name in ("a", "b")))
    source.push_weights()
    assert exported == ["a", "b"]  # the gathers ran


def test_separate_idle_seconds_by_hand():
    # Lock-step: windows (10, 12), then (15, 16): the rollout side idled 0 before the first (nothing
    # earlier), then 3 s between 12 and 15; the trainer's idle is its wait plus the refit's.
    split = SimpleNamespace(num_rollout_ranks=2, num_training_ranks=1, world_size=3)
    source = LockStepSource(SimpleNamespace(), split, SimpleNamespace(buckets=lambda: iter(())), max_staleness=0,
                            prompts_per_step=2, pad_id=0)
    assert source.rollout_gpus == 2
    first = StepRollout(VersionedRollout(None, version=0, problems_drawn=2, generated=(10.0, 12.0)))
    figures = source.figures(1, first, 0.75, RefitOutcome(None, 0.25))
    assert figures.values == {"timing/train_idle_s": 1.0, "timing/rollout_idle_s": 0.0}
    assert figures.wait_phase == "wait" and figures.windows == [("rollout rank", "generation", (10.0, 12.0))]
    second = StepRollout(VersionedRollout(None, version=1, problems_drawn=4, generated=(15.0, 16.0)))
    assert source.idle_seconds(second, 2.0, RefitOutcome(None, 0.0)) == pytest.approx(
        {"timing/train_idle_s": 2.0, "timing/rollout_idle_s": 3.0})


def test_free_running_rollout_idle_is_the_mean_over_rollout_ranks_by_hand():
    # Two rollout ranks. Step 1: rank 0 sent (10, 12), rank 1 (10, 13): no gaps yet. Step 2: rank 0
    # (12.5, 14) dropped then (15, 16); rank 1 (13, 17): rank 0 idled 0.5 + 1.0, rank 1 0 -> mean 0.75.
    free = SimpleNamespace(split=SimpleNamespace(num_rollout_ranks=2), _ends={})
    step1 = StepRollout(None, pieces=[Piece(0, 1, 0, (10.0, 12.0)), Piece(1, 1, 0, (10.0, 13.0))])
    assert FreeRunningSource.rollout_idle(free, step1) == 0.0
    step2 = StepRollout(None, pieces=[Piece(1, 2, 1, (13.0, 17.0)), Piece(0, 3, 1, (15.0, 16.0))],
                        dropped=[Piece(0, 2, 0, (12.5, 14.0))])
    assert FreeRunningSource.rollout_idle(free, step2) == pytest.approx(0.75)
