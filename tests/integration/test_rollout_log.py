"""``trainer.rollout_log``: one record per response per step, its values checked against what they
must be independently of the logging code (the parity reward recomputed from the response text, the
GRPO advantage recomputed from the logged rewards by hand, the step's logged means), kept and
replaced on resume like ``metrics.jsonl``, and cleared by ``trainer.overwrite_output_dir``. The same
run shows the phase lines inside a step (``trainer.progress_interval_s``, here every phase) and the
checkpoint saves in ``timing/checkpoint_s`` and the timeline, and its resume, once finished, removes an
earlier stop's stale ``hf_checkpoint_interrupted``."""

import json
import statistics
from collections import defaultdict

import pytest

from nemo_sspo.models import load_hf_checkpoint
from tests.integration._loop_runs import run

LOG = ["trainer.rollout_log=true", "trainer.max_steps=2", "trainer.checkpoint_interval=1"]
EVERY_PHASE = "trainer.progress_interval_s=1e-9"  # a line for every phase: their order is checked


def _log(out):
    return [json.loads(line) for line in (out / "rollouts" / "replica_000.jsonl").read_text().splitlines()]


def _metrics(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_rollout_log_values_resume_and_overwrite_and_phase_lines(monkeypatch, tmp_path, capsys):
    tiny = load_hf_checkpoint("tiny-random-llama")
    out = tmp_path / "run"
    run(monkeypatch, out, [*LOG, EVERY_PHASE], checkpoint=tiny)
    straight = _log(out)
    metrics = _metrics(out)
    # 2 prompt groups of 2, 2 optimizer steps per step of 2 rows, one micro-batch of 2 rows each, a
    # checkpoint after each step
    phases = [line.split(": ", 1)[1] for line in capsys.readouterr().err.splitlines() if line.startswith("step 1/2 [")]
    assert phases == ["generation, 2/4 responses", "generation, 4/4 responses", "scoring 4 responses", "old log-probs",
                      "update, 1/2 optimizer steps", "update, 1/2 optimizer steps, 1/1 micro-batches",
                      "update, 2/2 optimizer steps", "update, 2/2 optimizer steps, 1/1 micro-batches", "refit",
                      "checkpoint save"]
    # step 1's save is reported with step 2 (step 1's record was written before it), and in the timeline
    saves = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()
             if json.loads(line)["phase"] == "checkpoint"]
    assert [s["step"] for s in saves] == [1, 2] and "timing/checkpoint_s" not in metrics[1]
    assert metrics[2]["timing/checkpoint_s"] == pytest.approx(saves[0]["end"] - saves[0]["start"], rel=1e-6)
    assert [(r["step"], r["row"], r["sample"]) for r in straight] == [
        (step, row, row % 2) for step in (1, 2) for row in range(4)]  # 2 prompts x 2 samples per step
    for step in (1, 2):
        records = [r for r in straight if r["step"] == step]
        groups = defaultdict(list)
        for r in records:
            # ParityReward: 1 for an even character count; no overlong shaping here
            assert r["task_reward"] == r["reward"] == float(len(r["response"]) % 2 == 0)
            assert r["version"] == step - 1 and r["replica"] == 0  # colocated: the weights of step - 1 updates
            assert r["truncated"] == (r["response_length"] == 8)  # rollout.sampling.max_new_tokens=8, no stop token
            groups[r["prompt_id"]].append(r)
        assert len(groups) == 2
        for group in groups.values():
            rewards = [r["reward"] for r in group]
            assert len({r["prompt"] for r in group}) == 1
            # GRPO: (r - mean) / (population std + 1e-6), 0 for a group of equal rewards
            mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
            for r in group:
                expected = 0.0 if std == 0 else (r["reward"] - mean) / (std + 1e-6)
                assert r["advantage"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
        assert statistics.fmean(r["task_reward"] for r in records) == pytest.approx(metrics[step]["reward/mean"])
        assert statistics.fmean(r["response_length"] for r in records) == pytest.approx(
            metrics[step]["response/length_mean"])
    assert any(r["advantage"] != 0 for r in straight)  # the parity reward varies within a group

    # Resumed from step 1: step 1's records kept, step 2's written again once (the same seed: equal).
    # An earlier stop's export is stale once the resumed run finishes: it is removed.
    (out / "hf_checkpoint_interrupted").mkdir()
    (out / "hf_checkpoint_interrupted" / "config.json").write_text("{}")
    run(monkeypatch, out, [*LOG, f"trainer.resume={out / 'checkpoints' / 'step_000001'}"], checkpoint=tiny)
    assert _log(out) == straight
    assert not (out / "hf_checkpoint_interrupted").exists()

    # Started over in the same folder without the log: the earlier run's is deleted with its other outputs.
    run(monkeypatch, out, ["trainer.max_steps=1"], checkpoint=tiny)
    assert not (out / "rollouts").exists() and list(_metrics(out)) == [1]
