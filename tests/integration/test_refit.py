"""In-process loop run with a reward that varies, so updates really change the weights.

Checks that the rollout engine follows the policy (refit) and that the second mini-batch of a
step is off-policy (docs/pitfalls.md#p5: with one update per rollout the ratio is exactly 1).
"""

import torch

from nemo_sspo.cli import load_config
from nemo_sspo.megatron import destroy_parallel, export_hf_state_dict
from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.rollout import HFRolloutEngine
from nemo_sspo.trainer import loop, policy, setup
from tests.integration._loop_runs import ParityReward as _ParityReward


def test_updates_change_weights_and_refit_follows(monkeypatch, tmp_path):
    cfg = load_config(overrides=[
        "model=tiny_random", "trainer.max_steps=2", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.sampling.max_new_tokens=12", "parallel.micro_batch_size=2",
        "optim.lr=1e-2", f"trainer.output_dir={tmp_path}",
    ])
    _, initial, _ = load_hf_checkpoint("tiny-random-llama")
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), reward=_ParityReward())
    try:
        step1, step2 = trainer.fit()
        policy = export_hf_state_dict(trainer.model.module, trainer.hf_config)
        rollout = trainer.engine.model.state_dict()
    finally:
        destroy_parallel()
    assert step1["advantages/zero_variance_group_frac"] < 1.0
    assert step1["optim/grad_norm"] > 0
    assert step1["policy/approx_kl_k3"] > 0  # the second mini-batch saw updated weights
    # the rollout engine holds exactly the policy's weights, and they moved away from the start
    for name in initial:
        assert torch.equal(rollout[name], policy[name]), name
    moved = max(float((policy[n] - initial[n]).abs().max()) for n in initial)
    assert moved > 1e-4
    # step 2 sampled with the refitted weights: rollout and trainer log-probs agree to rounding
    assert step2["rollout/trainer_logprob_gap_abs"] < 1e-4
    # the streamed refit (buckets of whole layers, loaded one by one) leaves the engine sampling exactly
    # as one built from the full export does (the refit before streaming): same ids, same log-probs
    full = HFRolloutEngine(build_hf_model(trainer.hf_config, initial), trainer.tokenizer, max_new_tokens=12,
                           temperature=cfg.rollout.sampling.temperature, stop_token_ids=trainer.engine.stop_token_ids)
    full.load_weights(policy)
    prompts = ["Tom has 3 apples and buys 2 more.", "What is 2 + 2?"]
    streamed_batch, full_batch = trainer.engine.generate(prompts, seed=3), full.generate(prompts, seed=3)
    assert torch.equal(streamed_batch.response_ids, full_batch.response_ids)
    assert torch.equal(streamed_batch.rollout_logprobs, full_batch.rollout_logprobs)
    stale = HFRolloutEngine(build_hf_model(trainer.hf_config, initial), trainer.tokenizer, max_new_tokens=12,
                            temperature=cfg.rollout.sampling.temperature, stop_token_ids=trainer.engine.stop_token_ids)
    assert not torch.equal(stale.generate(prompts, seed=3).rollout_logprobs, full_batch.rollout_logprobs)


class _NaNOnSecondCallReward(_ParityReward):
    """A broken reward function: fine on step 1, NaN on step 2."""

    calls = 0

    def __call__(self, responses, answers):
        type(self).calls += 1
        return super().__call__(responses, answers) if self.calls == 1 else [float("nan")] * len(responses)


def test_nan_reward_fails_clearly_and_keeps_completed_work(monkeypatch, tmp_path):
    import json

    import pytest

    cfg = load_config(overrides=[
        "model=tiny_random", "trainer.max_steps=3", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.sampling.max_new_tokens=8", "parallel.micro_batch_size=2",
        f"trainer.output_dir={tmp_path}",
    ])
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed),
                               reward=_NaNOnSecondCallReward())
    try:
        with pytest.raises(ValueError, match="finite"):
            trainer.fit()
    finally:
        destroy_parallel()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert (tmp_path / "hf_checkpoint_interrupted" / "config.json").is_file()


def test_non_finite_gradient_stops_the_run_and_keeps_the_last_good_policy(monkeypatch, tmp_path):
    """A NaN gradient norm (e.g. an overflowing loss) raises; step 1's policy is what gets saved."""
    import json

    import pytest
    from transformers import AutoModelForCausalLM

    real_train_on_batch = policy.train_on_batch
    calls = {"n": 0}

    def nan_from_step_2(*args, **kwargs):
        sums, grad_norm = real_train_on_batch(*args, **kwargs)
        calls["n"] += 1
        return sums, (float("nan") if calls["n"] > 2 else grad_norm)  # 2 mini-batches per step

    monkeypatch.setattr(policy, "train_on_batch", nan_from_step_2)
    cfg = load_config(overrides=[
        "model=tiny_random", "trainer.max_steps=3", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.sampling.max_new_tokens=8", "parallel.micro_batch_size=2",
        "optim.lr=1e-2", f"trainer.output_dir={tmp_path}",
    ])
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), reward=_ParityReward())
    try:
        refit = trainer.source.push_weights
        good = {}

        def refit_and_keep():  # the policy after each completed step, as exported for the refit
            refit()
            good["policy"] = export_hf_state_dict(trainer.model.module, trainer.hf_config)

        trainer.source.push_weights = refit_and_keep
        with pytest.raises(FloatingPointError, match="mini-batch 1"):
            trainer.fit()
        after_bad_update = export_hf_state_dict(trainer.model.module, trainer.hf_config)
    finally:
        destroy_parallel()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_checkpoint_interrupted").state_dict()
    # The saved policy is exactly step 1's (the last good one), tensor for tensor, and not the
    # Megatron weights after the update whose gradient norm was NaN.
    assert set(good["policy"]) <= set(saved)
    for name, value in good["policy"].items():
        assert torch.equal(saved[name], value), name
    assert any(not torch.equal(after_bad_update[n], good["policy"][n]) for n in good["policy"])
