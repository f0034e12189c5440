"""``rollout.schedule.placement: separate`` with the real vLLM CPU engine on the rollout rank, against colocated vLLM.

Two CLI runs of the same seed on the tiny random Qwen3 (2 layers, the Qwen vocabulary; 2 steps,
fp32 vLLM in-process): colocated in one process (also the CLI check of vLLM: its output holds no refit warning and no traceback), and
separate under torchrun (1 training rank + 2 rollout ranks, ``max_staleness=0``), where
each rollout rank builds its own engine (vLLM's world group is then the rollout side's 2 ranks, each
engine its own TP group), generates one of the step's 2 prompt groups and refits from the broadcast
buckets after step 1. Step 2's rollouts come from the refitted engines, so equal step-2 metrics also
check the broadcast refit. Measured: every compared metric bit-equal to colocated.
The reward is the tests' parity reward (a plugin), so the groups vary and the update moves the weights.
"""

import json
import subprocess
import sys

import pytest

from tests.integration._launch import REPO, free_port, launch_env
from tests.vllm.test_vllm_backend import TRAIN

# The tiny Qwen3 and the Qwen-Math template's short prompts keep the Megatron steps short, so the
# run is mostly the engines' start (86 s on 2 cores, against 156 s with SmolLM2-135M).
RUN = [*TRAIN, "plugins=[tests.integration._loop_runs]", "reward.name=test_parity", "optim.lr=1e-3",
       "rollout.correction.name=token_tis", "data.template=qwen-math"]
KEYS = ("reward/mean", "response/length_mean", "loss/policy", "optim/grad_norm", "policy/ratio",
        "rollout/kl_k3_behaviour", "rollout/is_weight", "rollout/trainer_logprob_gap_abs")


def _train(launcher, out, extra):
    cmd = [sys.executable, *launcher, "-m", "nemo_sspo.cli", "train", *RUN, f"trainer.output_dir={out}", *extra]
    run = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    # Each refit bucket reloads only some layers; vLLM's per-layer warnings about the others (about
    # 1,100 lines per refit before) stay quiet, and its engine stops before the trainer's process
    # groups (its exit-time teardown printed "Invalid process group specified" with a traceback).
    assert "Failed to load weights" not in run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_separate_vllm_with_two_rollout_ranks_equals_colocated_vllm(tmp_path):
    colocated = _train([], tmp_path / "colocated", [])
    separate = _train(["-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port())],
                      tmp_path / "separate", ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=2"])
    assert [s["step"] for s in separate] == [s["step"] for s in colocated] == [1, 2]
    assert all(s["rollout/trainer_logprob_gap_abs"] < 1e-4 for s in colocated)
    assert colocated[0]["optim/grad_norm"] > 0 and colocated[0]["reward/mean"] not in (0.0, 1.0)  # a real update
    for mine, ref in zip(separate, colocated, strict=True):
        for key in KEYS:
            assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (mine["step"], key)
    assert all(s["timing/refit_s_per_gb"] > 0 for s in separate)  # the broadcast ran after each step
