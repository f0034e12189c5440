"""SPPO (sequence-level PPO) in the loop: one sample per prompt, a smaller critic (1 of 2 layers),
A = r - sigmoid(V) with the critic before its update, BCE metrics, and the critic learning; and
the same critic/policy numbers under TP=2 and PP=2 (with the reference-KL model too)."""

import math

import pytest
import torch

from nemo_sspo.megatron import destroy_parallel, unwrap_model
from tests.integration._loop_runs import make_trainer, record_prepared, run

SPPO = ["loss=sppo", "rollout.samples_per_prompt=1", "rollout.prompts_per_step=4", "critic.micro_batch_size=2"]


def test_critic_baseline_and_training(monkeypatch, tmp_path):
    prepared = []

    def capture(trainer):
        assert len(unwrap_model(trainer.critic.model).decoder.layers) == 1  # critic.num_layers=1
        record_prepared(trainer, prepared)

    history = run(monkeypatch, tmp_path, [*SPPO, "trainer.max_steps=4", "critic.num_layers=1",
                                          "critic.optim.lr=0.05"], capture=capture)
    step1 = history[0]
    # Zero-initialised head: V = 0, p = 0.5 for every prompt -> BCE = ln 2, |p - r| = 0.5, A = r - 0.5.
    assert step1["critic/value_mean"] == pytest.approx(0.5, abs=1e-7)
    assert step1["critic/loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert step1["critic/abs_error"] == pytest.approx(0.5, abs=1e-7)
    seen = [(rollout.rewards, batch.advantages) for rollout, batch in prepared]
    rewards, advantages = seen[0]
    assert torch.allclose(advantages, rewards - 0.5, atol=1e-7)
    assert len(seen) == len(history) == 4
    for (rewards, advantages), record in zip(seen, history):
        # The logged reward means are those of the step's 4 captured rollout rewards (the critic's
        # BCE targets), averaged here in float64.
        reward_mean = rewards.double().mean().item()
        assert record["reward/mean"] == pytest.approx(reward_mean, abs=1e-7)
        assert record["critic/reward_mean"] == pytest.approx(reward_mean, abs=1e-7)
        # Each step's advantage uses the critic's prediction before that step's update, whose mean
        # the BCE pass reports: mean(A) = mean(r) - mean(p).
        assert advantages.mean().item() == pytest.approx(reward_mean - record["critic/value_mean"], abs=1e-5)
    # The critic learns: with a large step its prediction moves toward the running reward rate.
    assert history[-1]["critic/value_mean"] != pytest.approx(0.5, abs=1e-3)
    assert history[-1]["critic/grad_norm"] > 0


def _layout_metrics(rank, world_size, tmp_dir, layout):
    """Runs in a spawned gloo process: 2 steps of SPPO with a reference-KL term in ``layout``."""
    import pytest as _pytest

    trainer = make_trainer(_pytest.MonkeyPatch(), f"{tmp_dir}/{layout}{world_size}",
                           [*SPPO, f"parallel={layout}", "loss.params.kl_coef=0.1", "critic.optim.lr=0.05",
                            "optim.lr=1e-3"])
    try:
        return [trainer.train_step(step) for step in (1, 2)]
    finally:
        trainer.close()
        destroy_parallel()


@pytest.fixture(scope="module")
def single_process(run_distributed, tmp_path_factory):
    return run_distributed(_layout_metrics, 1, str(tmp_path_factory.mktemp("single")), "single")[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_critic_and_reference_match_a_single_process(run_distributed, single_process, tmp_path, layout):
    ranks = run_distributed(_layout_metrics, 2, str(tmp_path), layout)
    keys = ["critic/loss", "critic/value_mean", "critic/abs_error", "critic/grad_norm", "loss/policy",
            "policy/kl_ref", "optim/grad_norm", "reward/mean"]
    for step in range(2):
        for key in keys:
            assert ranks[0][step][key] == ranks[1][step][key], key  # every rank logs the same value
            assert ranks[0][step][key] == pytest.approx(single_process[step][key], rel=1e-4, abs=1e-6), (step, key)


def test_bad_critic_source_is_named_by_its_own_key(monkeypatch, tmp_path):
    # The checkpoint loader names its argument (source=...); the trainer adds the key the value came
    # from. Before, a missing critic folder was reported as model.source=..., the policy's key.
    missing = tmp_path / "no_such_critic"
    with pytest.raises(ValueError, match=rf"^critic\.source='{missing}' is not a built-in source"):
        try:
            make_trainer(monkeypatch, tmp_path, [*SPPO, f"critic.source={missing}"])
        finally:
            destroy_parallel()
