"""A 2-step run of the CLI on a tiny random Llama, as a user would start it."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.unit.test_metric_names import metric_table

REQUIRED_KEYS = {
    "reward/mean", "reward/accuracy", "response/length_mean", "response/truncated_frac",
    "policy/entropy", "policy/clipfrac_tokens", "policy/clipfrac_segments", "policy/b_low",
    "policy/b_high", "policy/segments_per_response", "policy/ratio", "loss/policy",
    "optim/grad_norm", "advantages/zero_variance_group_frac", "rollout/trainer_logprob_gap_abs", "policy/approx_kl_k3",
    "timing/generation_s", "timing/train_s", "timing/refit_s",
}
TINY = [
    "model=tiny_random", "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=24", "parallel.micro_batch_size=2", "reward.num_workers=1", "optim.lr=1e-3",
]


def _run(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "nemo_sspo.cli", "train", *args],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)


@pytest.mark.slow
def test_two_step_run_writes_finite_metrics(tmp_path):
    out = tmp_path / "run"
    proc = _run([*TINY, f"trainer.output_dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # every name of ours in docs/trackers.md's table next to verl and NeMo-RL is one this run logs
    documented = {ours for ours, _, _ in metric_table()}
    for r in records:
        assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
        assert documented <= set(r), documented - set(r)
        assert all(math.isfinite(v) for v in r.values())
        # Rollout and trainer log-probs come from the same weights (step 2: after the refit), fp32:
        # their gap is rounding only. A missed refit or a temperature mismatch shows up here.
        assert r["rollout/trainer_logprob_gap_abs"] < 1e-3
        # The random 2-layer model never writes a \boxed{} with the right answer (math-verify
        # scores every response 0) and never samples EOS within 24 tokens (seeded). So every group
        # has zero reward variance, every advantage is 0, the loss and its gradient are exactly 0,
        # Adam (no weight decay) leaves the weights where they were, and both steps are on-policy:
        # every ratio is 1, nothing is clipped, the KL estimate is 0.
        assert r["reward/mean"] == 0.0 and r["reward/accuracy"] == 0.0
        assert r["response/length_mean"] == 24.0 and r["response/truncated_frac"] == 1.0
        assert r["advantages/zero_variance_group_frac"] == 1.0
        assert r["loss/policy"] == 0.0 and r["optim/grad_norm"] == 0.0
        assert r["policy/ratio"] == 1.0 and r["policy/clipfrac_tokens"] == 0.0
        assert r["policy/approx_kl_k3"] == 0.0
    assert (out / "reward_entropy.png").stat().st_size > 0
    assert (out / "hf_checkpoint" / "config.json").is_file()
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    assert "step   2" in proc.stdout + proc.stderr
    # every response ran to the 24-token cap (above): one warning, at step 1
    assert proc.stderr.count("of the responses reached rollout.max_new_tokens=24 without a stop token") == 1
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
