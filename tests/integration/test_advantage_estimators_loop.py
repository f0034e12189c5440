"""``advantage.name`` in the loop: the estimator chosen by config (a built-in, or docs/extending.md's
plug-in loaded from its own file with ``plugins=``) gives the advantages every optimizer step trains on,
equal to a float64 reference of the step's rewards, whatever the micro-batch size."""

import pytest
import torch

from tests.integration._loop_runs import observe, record_updates, run
from tests.unit.advantage_reference import reference_advantages
from tests.unit.repo.test_docs import guide_files  # noqa: F401 - the fixture is used by name


def _steps(store):
    """Appends ``(rewards, task_rewards)`` of every step's rollout."""
    def capture(trainer):
        observe(trainer, "rollout", lambda got: store.append((got.versioned.rollout.rewards.tolist(),
                                                              got.versioned.rollout.task_rewards.tolist())))

    return capture


def _trained_advantages(monkeypatch, tmp_path, overrides):
    """``(rollouts, advantages of each step's updates concatenated)`` of a one-step run."""
    updates, rollouts = [], []
    record_updates(monkeypatch, updates)
    run(monkeypatch, tmp_path, ["trainer.max_steps=1", "rollout.samples_per_prompt=4", *overrides],
        capture=_steps(rollouts))
    return rollouts, torch.cat([batch.advantages for batch, _ in updates])


def _not_group(trained, rewards, task):
    """The run's advantages are not those of the default estimator (nor all 0): the choice was used."""
    group = torch.tensor(reference_advantages("group", rewards, 4, task_rewards=task), dtype=torch.float32)
    assert trained.abs().sum() > 0 and not torch.allclose(trained, group, rtol=1e-3, atol=1e-3), (
        "the parity reward gave rewards on which the estimators agree: pick another seed")


@pytest.mark.parametrize("name, minibatches, micro", [("batch_std", 1, 1), ("leave_one_out", 2, 4)])
def test_builtin_estimator_trains_on_its_reference(monkeypatch, tmp_path, name, minibatches, micro):
    # TINY with 4 responses per prompt: 2 x 4 = 8 rows, the parity reward (0/1 by response length).
    (rollout,), trained = _trained_advantages(monkeypatch, tmp_path, [
        f"advantage.name={name}", f"trainer.minibatches_per_step={minibatches}", f"parallel.micro_batch_size={micro}"])
    rewards, task = rollout
    want = reference_advantages(name, rewards, 4, minibatches=minibatches, task_rewards=task)
    torch.testing.assert_close(trained, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=1e-6)
    _not_group(trained, rewards, task)


def test_plugin_estimator_from_the_guide_is_used(monkeypatch, tmp_path, guide_files):  # noqa: F811
    (rollout,), trained = _trained_advantages(monkeypatch, tmp_path, [
        f"plugins=[{guide_files['my_advantage.py']}]", "advantage.name=positive_rate",
        "trainer.minibatches_per_step=1"])
    rewards, task = rollout
    # By hand (the guide's formula): one optimizer batch of the 8 rows, alpha = 8 / max(#non-zero task
    # rewards, 1), times r_i - mean_g r; 0 for a group whose task rewards are all equal.
    alpha = 8 / max(sum(t != 0 for t in task), 1)
    want = []
    for k in (0, 4):
        group, task_group = rewards[k:k + 4], task[k:k + 4]
        mean = sum(group) / 4
        want += [0.0] * 4 if max(task_group) == min(task_group) else [alpha * (r - mean) for r in group]
    torch.testing.assert_close(trained, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=1e-6)
    _not_group(trained, rewards, task)
