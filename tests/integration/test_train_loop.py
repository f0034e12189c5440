"""A 2-step run of the CLI on a tiny random Llama, as a user would start it."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_sspo.models import load_hf_checkpoint
from tests.integration._alternating_reward import REWARD as ALTERNATING_REWARD
from tests.unit.repo.test_metric_names import metric_table

ALTERNATING_PLUGIN = Path(__file__).with_name("_alternating_reward.py")

REQUIRED_KEYS = {
    "reward/mean", "reward/accuracy", "response/length_mean", "response/truncated_frac",
    "policy/entropy", "policy/clipfrac_tokens", "policy/clipfrac_segments", "policy/b_low",
    "policy/b_high", "policy/segments_per_response", "policy/ratio", "loss/policy",
    "optim/grad_norm", "advantages/zero_variance_group_frac", "rollout/trainer_logprob_gap_abs", "policy/approx_kl_k3",
    "timing/generation_s", "timing/train_s", "timing/refit_s",
}
TINY = [
    "model=tiny_random", "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
    "rollout.sampling.max_new_tokens=24", "parallel.micro_batch_size=2", "reward.options.num_workers=1", "optim.lr=1e-3",
]


def _run(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "nemo_sspo.cli", "train", *args],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)


@pytest.mark.slow
def test_two_step_run_writes_finite_metrics(tmp_path):
    out = tmp_path / "run"
    # The alternating reward gives every group of 4 the rewards 1, 0, 1, 0 (tests/integration/
    # _alternating_reward.py), so every advantage is +-1 and the update has a non-zero gradient; one
    # minibatch per step keeps both updates on-policy (ratio 1, values below by hand).
    proc = _run([*TINY, f"plugins=[{ALTERNATING_PLUGIN}]", f"reward.name={ALTERNATING_REWARD}",
                 "trainer.minibatches_per_step=1", f"trainer.output_dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # every name of ours in docs/trackers.md's table next to verl and NeMo-RL is one this run logs
    documented = {ours for ours, _, _ in metric_table()}
    for r in records:
        assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
        assert documented <= set(r), documented - set(r)
        assert all(math.isfinite(v) for v in r.values())
        # Rollout and trainer log-probs come from the same weights (step 2: after the refit of the
        # weights step 1 moved, checked below), fp32: their gap is rounding only. A missed refit or
        # a temperature mismatch shows up here.
        assert r["rollout/trainer_logprob_gap_abs"] < 1e-3
        # Every group scores 1, 0, 1, 0: mean reward and accuracy 1/2, no zero-variance group, and
        # advantages (r - 1/2) / (population std 1/2 + eps) = +-1. The random 2-layer model never
        # samples EOS within 24 tokens (seeded). One update per step on the step's own rollout:
        # every ratio is 1, nothing is clipped, the KL estimate is 0, and each token's loss is -A_i,
        # so seq-mean-token-mean gives -(1 - 1 + 1 - 1) / 4 = 0 per group (exactly: +-1 cancel), while
        # the gradient, sum_i -A_i * mean_t d logp_it / 4 per group, is not 0.
        assert r["reward/mean"] == 0.5 and r["reward/accuracy"] == 0.5
        assert r["response/length_mean"] == 24.0 and r["response/truncated_frac"] == 1.0
        assert r["advantages/zero_variance_group_frac"] == 0.0
        assert r["loss/policy"] == 0.0 and r["optim/grad_norm"] > 0.0
        assert r["policy/ratio"] == 1.0 and r["policy/clipfrac_tokens"] == 0.0
        assert r["policy/approx_kl_k3"] == 0.0
    assert (out / "reward_entropy.png").stat().st_size > 0
    assert (out / "hf_checkpoint" / "config.json").is_file()
    # The two updates moved the weights. Adam (constant lr 1e-3, no weight decay; gradient clipping
    # only rescales g, which Adam ignores up to eps = 1e-8) moves a weight of gradient g by
    # lr * g / (|g| + eps) = lr in size at step 1. At step 2 (bias-corrected, beta1 0.9, beta2 0.999)
    # by lr * (a1 g1 + a2 g2) / sqrt(b1 g1^2 + b2 g2^2), a1 = 0.09/0.19, a2 = 0.1/0.19,
    # b1 = 0.000999/0.001999, b2 = 0.001/0.001999: exactly lr where g2 = g1, at most
    # lr * sqrt(a1^2/b1 + a2^2/b2) = 1.0013579 lr (Cauchy-Schwarz; at g2 = 1.11 g1). So the largest
    # move is 2e-3 to 2.0013579e-3 (the step-2 factor is >= 1 for g2/g1 in [1, 1.22], which some of the
    # model's millions of weights have; fp32 rounding: 1e-4 either side); a skipped update leaves it 0.
    _, initial, _ = load_hf_checkpoint("tiny-random-llama")
    _, final, _ = load_hf_checkpoint(str(out / "hf_checkpoint"))
    assert set(final) <= set(initial), set(final) - set(initial)
    moved = max(float((final[k].double() - initial[k].double()).abs().max()) for k in final)
    assert 2e-3 * (1 - 1e-4) <= moved <= 2.0013579e-3 * (1 + 1e-4), moved
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    assert "step   2" in proc.stdout + proc.stderr
    # every response ran to the 24-token cap (above): one warning, at step 1
    assert proc.stderr.count("of the responses reached rollout.sampling.max_new_tokens=24 without a stop token") == 1
    assert "step 1: 100% of the responses reached" in proc.stderr
    assert (out / "config.yaml").is_file()  # the composed config is saved with the run


def test_bad_override_exits_with_a_clear_message(tmp_path):
    proc = _run(["trainer.max_stpes=2"], tmp_path)
    assert proc.returncode == 2
    assert "max_stpes" in proc.stderr


def test_rerun_into_an_earlier_run_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = _run(["model=tiny_random", f"trainer.output_dir={out}"], tmp_path)
    assert proc.returncode == 2
    assert "trainer.overwrite_output_dir" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
