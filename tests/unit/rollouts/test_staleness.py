"""Lock-step staleness: which weights generate which step's rollout, the version-lag metrics, and the
settings refused at load."""

from types import SimpleNamespace

import pytest
import torch

from nemo_sspo.cli import load_config
from nemo_sspo.rollouts.records import Rollout
from nemo_sspo.rollouts.records import VersionedRollout
from nemo_sspo.rollouts.staleness import LockStepRollouts, version_lag_sums


def _run(max_staleness, last_step):
    """Drives the queue as the trainer does; returns (step trained, step generated, version) triples."""
    queue, generated = LockStepRollouts(max_staleness, last_step), []
    trained = []
    for step in range(1, last_step + 1):
        version = step - 1  # the engine holds the weights after step - 1's update

        def generate(ahead, version=version, step=step):
            generated.append((step, ahead, version))
            return VersionedRollout(rollout=ahead, version=version, problems_drawn=10 * ahead)

        taken = queue.take(step, generate)
        trained.append((step, taken.rollout, taken.version))
    return generated, trained


def test_lock_step_generates_k_steps_ahead_in_step_order():
    generated, trained = _run(max_staleness=2, last_step=5)
    # Step 1 generates steps 1..3 with version 0; steps 2 and 3 generate steps 4 and 5 with their
    # starting weights (versions 1, 2); steps 4 and 5 generate nothing (beyond the last step).
    assert generated == [(1, 1, 0), (1, 2, 0), (1, 3, 0), (2, 4, 1), (3, 5, 2)]
    # Lags (step - 1 - version): 0, 1, 2, 2, 2 = min(step - 1, k).
    assert [step - 1 - version for step, _, version in trained] == [0, 1, 2, 2, 2]
    assert [rollout for _, rollout, _ in trained] == [1, 2, 3, 4, 5]


def test_zero_staleness_is_on_policy():
    generated, trained = _run(max_staleness=0, last_step=3)
    assert generated == [(1, 1, 0), (2, 2, 1), (3, 3, 2)]
    assert all(step - 1 == version for step, _, version in trained)


def test_negative_staleness_is_refused():
    with pytest.raises(ValueError, match="max_staleness=-1"):
        LockStepRollouts(-1, 3)


def test_version_lag_metrics():
    rollout = Rollout(batch=SimpleNamespace(token_versions=None), task_rewards=torch.zeros(6), rewards=torch.zeros(6),
                      rounds=1, generated_groups=3, prompt_keys=["a" * 32, "b" * 32, "c" * 32])  # one version for all
    sums = version_lag_sums(VersionedRollout(rollout, version=2, problems_drawn=0), step=5)
    # step 5 starts from version 4: lag 2 for each of the 6 samples
    assert sums["rollout/version_lag_mean"].as_tensor().tolist() == [12.0, 6.0]
    assert sums["rollout/version_lag_max"].kind == "max"
    assert sums["rollout/version_lag_max"].as_tensor().tolist() == [2.0, 6.0]


@pytest.mark.parametrize("overrides, match", [
    (["rollout.schedule.max_staleness=1"], r"rollout\.schedule\.max_staleness=1 .* set rollout\.correction\.name"),
    (["rollout.schedule.max_staleness=-1", "rollout.correction.name=token_tis"], r"rollout\.schedule\.max_staleness=-1 must be >= 0"),
    (["rollout.correction.name=token_mask", "rollout.correction.low=2.0", "rollout.correction.high=2.0"],
     r"rollout\.correction\.low=2\.0 and rollout\.correction\.high=2\.0 must satisfy 0 <= low < high"),
    (["rollout.correction.name=tis"], r"rollout\.correction\.name='tis' is unknown; valid: none, token_tis"),
    (["rollout.tis_cap=2.0"], r"rollout\.tis_cap was removed: use rollout\.correction\.name=token_tis"),
])
def test_bad_async_settings_fail_at_load(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(overrides=["model=tiny_random", *overrides])


def test_staleness_with_a_correction_loads():
    cfg = load_config(overrides=["model=tiny_random", "rollout.schedule.max_staleness=2", "rollout.correction.name=segment_tis"])
    assert (cfg.rollout.schedule.max_staleness, cfg.rollout.correction.name) == (2, "segment_tis")


@pytest.mark.parametrize("world, overrides, match", [
    ("1", ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1"], r"rollout\.schedule\.num_ranks=1 leaves no training rank"),
    ("2", ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=0"], r"rollout\.schedule\.num_ranks=0: .* at least one rollout rank"),
    # 2 training ranks + 3 rollout ranks: 4 prompt groups per step do not split over 3 rollout ranks
    ("5", ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=3", "rollout.prompts_per_step=4"],
     r"rollout\.schedule\.num_ranks=3 does not divide rollout\.prompts_per_step=4"),
    ("2", ["rollout.schedule.num_ranks=1"], r"rollout\.schedule\.num_ranks=1 needs rollout\.schedule\.placement=separate"),
    ("2", ["rollout.schedule.placement=remote"], r"rollout\.schedule\.placement='remote' is unknown; valid: colocated, separate"),
    ("2", ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1", "eval.every_n_steps=1"],
     r"does not support eval\.every_n_steps > 0"),
    ("2", ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1", "rollout.schedule.peer_timeout_s=0"],
     r"rollout\.schedule\.peer_timeout_s=0\.0 must be > 0"),
    # 3 training ranks + 1 rollout rank: the 2 prompts per step do not split over DP 3
    ("4", ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1"], r"data-parallel size \(3\)"),
])
def test_bad_placement_fails_at_load(monkeypatch, world, overrides, match):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=match):
        load_config(overrides=["model=tiny_random", *overrides])


@pytest.mark.parametrize("world, rollout_ranks, backend", [("3", 1, "hf"), ("4", 2, "hf"), ("2", 1, "vllm")])
def test_separate_placement_counts_only_training_ranks(monkeypatch, world, rollout_ranks, backend):
    # 2 training ranks (DP 2) + 1 or 2 rollout ranks, or 1 + 1 with the vLLM engine: the 2 prompts per
    # step split over DP 2 and over R rollout ranks.
    monkeypatch.setenv("WORLD_SIZE", world)
    cfg = load_config(overrides=["model=tiny_random", "rollout.schedule.placement=separate", f"rollout.schedule.num_ranks={rollout_ranks}",
                                 f"rollout.engine.backend={backend}"])
    assert (cfg.rollout.schedule.placement, cfg.rollout.schedule.num_ranks, cfg.rollout.engine.backend) == ("separate", rollout_ranks, backend)


def test_slot_rows_trim_to_their_own_padding():
    from nemo_sspo.rollout import RolloutBatch
    from nemo_sspo.rollouts.slots import slot_rows

    # Row 0: prompt of 1 token (left-padded to 3), response of 3; row 1: prompt of 3, response of 1.
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[0, 0, 5], [6, 7, 8]]), prompt_mask=torch.tensor([[False, False, True], [True] * 3]),
        response_ids=torch.tensor([[1, 2, 3], [4, 0, 0]]), response_mask=torch.tensor([[True] * 3, [True, False, False]]),
        truncated=torch.tensor([True, False]), response_texts=["abc", "d"],
        rollout_logprobs=torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]]))
    # Two groups of one response each (samples_per_prompt = 1): each row keeps its own group's key.
    rollout = Rollout(batch=batch, task_rewards=torch.tensor([1.0, 0.0]), rewards=torch.tensor([0.5, 0.0]), rounds=2,
                      generated_groups=3, prompt_keys=["0" * 32, "f" * 32])
    second = slot_rows(rollout, 1, 2)
    # row 1 alone: prompt width 3 (no padding to drop), response width 1
    assert second.batch.prompt_ids.tolist() == [[6, 7, 8]] and second.batch.response_ids.tolist() == [[4]]
    assert second.batch.rollout_logprobs.tolist() == [[-4.0]] and second.batch.response_texts == ["d"]
    assert second.prompt_keys == ["f" * 32]
    first = slot_rows(rollout, 0, 1)
    # row 0 alone: prompt width 1, response width 3
    assert first.batch.prompt_ids.tolist() == [[5]] and first.batch.prompt_mask.tolist() == [[True]]
    assert first.batch.response_ids.tolist() == [[1, 2, 3]] and first.batch.truncated.tolist() == [True]
    assert (first.task_rewards.tolist(), first.rewards.tolist(), first.rounds, first.generated_groups) == \
        ([1.0], [0.5], 2, 3)
