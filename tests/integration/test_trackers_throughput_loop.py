"""A 2-step run with trainer.loggers=[jsonl,tensorboard,wandb,mlflow]: every logger holds the run's
per-step values (read back with each tracker's own reader), and the step's FLOPs, tokens/s and MFU
equal a count made independently from the model's own weight matrices and the rollout's lengths."""

import json

import pytest
import torch

from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.trainer.throughput import PEAK_TFLOPS_ENV
from tests.integration._loop_runs import ParityReward, record_rollouts, run
from tests.unit._tracker_readers import mlflow_runs, tensorboard_scalars, wandb_history


def _independent_train_flops(checkpoint, rollout) -> float:
    """4 forward-pass equivalents (old log-probs 1, update forward 1 + backward 2) of the rollout:
    2 FLOPs per weight of every decoder matrix per token, the tied output layer on response tokens,
    and QK^T + AV over the causal pairs of each sequence."""
    hf_config, state_dict, _ = checkpoint
    matrices = sum(t.numel() for k, t in state_dict.items() if ".layers." in k and t.dim() == 2)
    rb = rollout.batch
    lengths = (rb.prompt_mask.sum(1) + rb.response_mask.sum(1)).double()
    responses = float(rb.response_mask.sum())
    pairs = float((lengths * (lengths + 1) / 2).sum())
    attention = 4 * hf_config.num_hidden_layers * hf_config.hidden_size * pairs  # n_q * d = hidden here
    return 4 * (2 * matrices * float(lengths.sum()) + attention + 2 * responses * hf_config.hidden_size
                * hf_config.vocab_size)


class TimingOutReward(ParityReward):
    """Parity scores, except that a response whose length is a multiple of 3 "times out" (scores 0
    and counts in ``timeouts``, as ``MathVerifyReward`` counts a response past its deadline)."""

    def __init__(self, **_):
        self.timeouts = 0

    def __call__(self, responses, answers):
        late = [len(r) % 3 == 0 for r in responses]
        self.timeouts += sum(late)
        return [0.0 if t else s for t, s in zip(late, super().__call__(responses, answers), strict=True)]


SECRETS = {"WANDB_API_KEY": "wandb-secret-7f3a91", "MLFLOW_TRACKING_PASSWORD": "mlflow-secret-c2d845",
           "MLFLOW_TRACKING_TOKEN": "mlflow-token-9be017", "MLFLOW_TRACKING_USERNAME": "mlflow-user-51aa0e"}


@pytest.mark.slow
def test_run_writes_every_tracker_and_reports_throughput(monkeypatch, tmp_path, capfd):
    checkpoint = load_hf_checkpoint("tiny-random-llama")
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "0.5")
    for key, value in SECRETS.items():  # credentials in the environment (never used: offline W&B, local MLflow)
        monkeypatch.setenv(key, value)
    rollouts = []

    def capture(trainer):
        record_rollouts(trainer, rollouts)

    history = run(monkeypatch, tmp_path, ["trainer.loggers=[console,jsonl,tensorboard,wandb,mlflow]"],
                  checkpoint=checkpoint, capture=capture, reward=TimingOutReward)
    assert [h["step"] for h in history] == [1, 2]
    for record, rollout in zip(history, rollouts, strict=True):
        # The step's share of timed-out responses, counted from the response texts.
        texts = rollout.batch.response_texts
        assert record["reward/timeout_frac"] == sum(len(r) % 3 == 0 for r in texts) / len(texts)
        assert record["flops/train"] == pytest.approx(_independent_train_flops(checkpoint, rollout), rel=1e-12)
        tokens = float(rollout.batch.prompt_mask.sum() + rollout.batch.response_mask.sum())
        assert record["tokens/prompt"] + record["tokens/response"] == tokens
        # One process: colocated generation and training share its one "GPU".
        assert record["flops/generation"] == pytest.approx(record["flops/train"] / 4, rel=1e-12)  # 1 of 4 passes
        assert record["throughput/tokens_per_s_per_gpu"] == pytest.approx(tokens / record["timing/step_s"])
        assert record["throughput/generation_tokens_per_s"] == pytest.approx(
            record["tokens/response"] / record["timing/rollout_generation_s"])
        assert record["throughput/train_mfu"] == pytest.approx(record["flops/train"] / record["timing/train_s"] / 0.5e12)
        assert record["throughput/mfu"] == pytest.approx(
            1.25 * record["flops/train"] / record["timing/step_s"] / 0.5e12)
        # The generation window (generation and scoring) lies inside the step's wait for its rollout.
        assert 0 < record["timing/rollout_generation_s"] <= record["timing/generation_s"]
        # The step's time covers its phases.
        phases = sum(record[f"timing/{p}_s"] for p in ("generation", "train", "refit"))
        assert phases <= record["timing/step_s"] < phases + 1.0

    keys = ("reward/mean", "policy/entropy", "throughput/mfu")
    expected = {key: [(h["step"], h[key]) for h in history] for key in keys}
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {key: [(r["step"], r[key]) for r in jsonl] for key in keys} == expected
    for key in keys:  # TensorBoard stores float32
        assert tensorboard_scalars(tmp_path / "tensorboard", key) == [
            (s, torch.tensor(v, dtype=torch.float32).item()) for s, v in expected[key]]
    (wandb_run,) = (tmp_path / "wandb").glob("offline-run-*")
    rows, config = wandb_history(wandb_run)
    assert {key: [(r["_step"], r[key]) for r in rows if key in r] for key in keys} == expected
    assert config["trainer"]["loggers"] == ["console", "jsonl", "tensorboard", "wandb", "mlflow"]
    client, (mlflow_run,) = mlflow_runs(tmp_path)
    assert {key: [(m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, key)]
            for key in keys} == expected
    assert mlflow_run.data.params["rollout.samples_per_prompt"] == "2"
    assert mlflow_run.data.params["loss.params.gamma"] == "1.75"
    assert [a.path for a in client.list_artifacts(mlflow_run.info.run_id)] == ["reward_entropy.png"]

    # No credential from the environment reaches a file of the run (config.yaml, metrics, events,
    # the W&B run folder with its logs and metadata, the MLflow store), the console or the parameters.
    printed = capfd.readouterr()
    for path in [p for p in tmp_path.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        assert not [key for key, value in SECRETS.items() if value.encode() in data], path
    assert not [key for key, value in SECRETS.items() if value in printed.out + printed.err]
    assert not [key for key, value in SECRETS.items() if value in str(mlflow_run.data.params) + str(config)]
    assert any(tmp_path.joinpath("wandb").rglob("debug*.log"))  # W&B's own logs were among the files read
