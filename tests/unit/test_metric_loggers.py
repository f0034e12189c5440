"""trainer.loggers: every selected logger gets the same per-step values, read back with each
tracker's own reader; W&B and MLflow also get the composed config and the plot; a resumed run
continues the same tracker runs."""

import json
from types import SimpleNamespace

import pytest

from nemo_sspo.cli import load_config
from nemo_sspo.trainer.config import TrainerConfig
from nemo_sspo.trainer.metric_log import MetricsLogger
from tests.unit._tracker_readers import mlflow_runs, tensorboard_scalars, wandb_history

STEPS = {1: {"reward/mean": 0.25, "timing/step_s": 4.0, "throughput/mfu": 0.5},
         2: {"reward/mean": 0.75, "timing/step_s": 2.0, "throughput/mfu": 0.25},
         3: {"reward/mean": 1.0, "timing/step_s": 3.0, "throughput/mfu": 0.125}}
ALL = ["console", "jsonl", "tensorboard", "wandb", "mlflow"]


def _log(out, steps, *, resume_step=None, loggers=ALL):
    trainer = TrainerConfig(loggers=list(loggers), output_dir=str(out))
    log = MetricsLogger(out, 3, enabled=True, resume_step=resume_step, trainer=trainer,
                        params={"trainer": {"seed": 7, "loggers": list(loggers)}, "loss": {"name": "sspo"}})
    for step in steps:
        log.log(step, STEPS[step])
    log.close()
    return log


@pytest.mark.slow
def test_all_loggers_record_the_same_values_and_a_resume_continues_the_runs(tmp_path, capsys):
    out = tmp_path / "run"
    _log(out, [1, 2])
    # The "interrupted" run resumes after step 1: step 2 is logged again, then step 3.
    log = _log(out, [2, 3], resume_step=1)
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [1, 2, 3]
    assert [r["reward/mean"] for r in jsonl] == [0.25, 0.75, 1.0]
    assert tensorboard_scalars(out / "tensorboard", "reward/mean") == [(1, 0.25), (2, 0.75), (3, 1.0)]

    # W&B: offline runs under output_dir/wandb, the same run id both times (wandb sync merges them).
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1
    first, first_config = wandb_history(runs[0])
    second, _ = wandb_history(runs[1])
    assert [(r["_step"], r["reward/mean"]) for r in first if "reward/mean" in r] == [(1, 0.25), (2, 0.75)]
    assert [(r["_step"], r["reward/mean"]) for r in second if "reward/mean" in r] == [(2, 0.75), (3, 1.0)]
    assert first_config["trainer"] == {"seed": 7, "loggers": ALL} and first_config["loss"] == {"name": "sspo"}
    (image,) = [r for r in second if "plots/reward_entropy/path" in r]
    assert image["_step"] == 3 and image["plots/reward_entropy/format"] == "png"
    assert (runs[1] / "files" / image["plots/reward_entropy/path"]).stat().st_size == (out / "reward_entropy.png").stat().st_size

    # MLflow: one run in the local SQLite store, its parameters flattened, the plot as an artifact.
    client, mlruns = mlflow_runs(out)
    (run,) = mlruns
    assert run.data.params == {"trainer.seed": "7", "trainer.loggers": str(ALL), "loss.name": "sspo"}
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")]
    assert sorted(history) == [(1, 0.25), (2, 0.75), (2, 0.75), (3, 1.0)]  # step 2 from both runs
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["reward_entropy.png"]
    assert run.info.status == "FINISHED"

    # The summary leaves out step 1 of the history (one-time costs): means of steps 2 and 3.
    assert log.summary["summary/timing/step_s"] == 2.5  # (2 + 3) / 2
    assert log.summary["summary/throughput/mfu"] == 0.1875  # (0.25 + 0.125) / 2
    assert json.loads((out / "throughput_summary.json").read_text()) == log.summary
    mlflow_summary = client.get_metric_history(run.info.run_id, "summary/timing/step_s")
    # Each of the two runs closes with its summary: the first over its step 2 only.
    assert [(m.step, m.value) for m in mlflow_summary] == [(2, 2.0), (3, 2.5)]
    assert "run summary: throughput/mfu=0.1875" in capsys.readouterr().out


def test_loggers_left_out_write_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    _log(out, [1, 2], loggers=["jsonl"])
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "reward_entropy.png", "throughput_summary.json"]
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("override, message", [
    ("trainer.loggers=[jsonl,neptune]", "trainer.loggers has unknown names ['neptune']"),
    ("trainer.loggers=[jsonl,jsonl]", "names a logger twice"),
    ("trainer.wandb.mode=cloud", "trainer.wandb.mode='cloud' is unknown; valid: offline, online"),
])
def test_bad_logger_settings_fail_at_load_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(overrides=[override])


def test_resume_without_jsonl_is_refused():
    with pytest.raises(ValueError, match="trainer.resume='auto' needs 'jsonl' in trainer.loggers"):
        load_config(overrides=["trainer.loggers=[console]", "trainer.resume=auto"])


def test_a_missing_tracker_package_names_the_fix(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    with pytest.raises(ValueError, match="package mlflow-skinny is not installed: run `bash install.sh`"):
        load_config(overrides=["trainer.loggers=[jsonl,mlflow]"])
    assert load_config(overrides=["trainer.loggers=[jsonl,wandb]"]).trainer.loggers == ["jsonl", "wandb"]


def test_a_failing_plot_still_writes_the_summary_and_closes_the_files(tmp_path, monkeypatch):
    from nemo_sspo.trainer import metric_log

    def broken(history, path):
        raise ModuleNotFoundError("No module named 'matplotlib'")

    monkeypatch.setattr(metric_log, "plot_metrics", broken)
    out = tmp_path / "run"
    log = MetricsLogger(out, 2, enabled=True, trainer=TrainerConfig(loggers=["jsonl", "tensorboard"]))
    log.log(1, STEPS[1])
    log.log(2, STEPS[2])
    with pytest.raises(ModuleNotFoundError, match="matplotlib"):
        log.close()
    assert log._jsonl.closed
    # The summary covers step 2 only (step 1 is left out).
    assert json.loads((out / "throughput_summary.json").read_text()) == {
        "summary/throughput/mfu": 0.25, "summary/timing/step_s": 2.0, "summary/steps": 1.0}
    assert tensorboard_scalars(out / "tensorboard", "reward/mean") == [(1, 0.25), (2, 0.75)]



def test_changes_allowed_on_resume_reach_the_trackers(tmp_path):
    """MLflow keeps a parameter's first value, so a resume that changes the learning rate adds
    ``optim.lr/from_step_3`` beside it; W&B's config gets the current values of the changed
    sections (issue 32). MLflow for real; W&B through a stand-in run (its init costs ~20 s here)."""
    from nemo_sspo.trainer.trackers import WandbTracker

    out = tmp_path / "run"
    # One MLflow run whose parameters hold lr 2e-5, as the first run logged them (one tracker start
    # instead of two: a resumed logger reopens that run and logs no parameters).
    log = MetricsLogger(out, 3, enabled=True, trainer=TrainerConfig(loggers=["mlflow"], output_dir=str(out)),
                        params={"optim": {"lr": 2e-5, "weight_decay": 0.0}, "loss": {"name": "sspo"}})
    log.log_config_changes(2, {"optim.lr": (2e-5, 1e-5)})  # resumed after step 2 with lr 1e-5
    log.close()
    _, (run,) = mlflow_runs(out)
    assert run.data.params == {"optim.lr": "2e-05", "optim.weight_decay": "0.0", "loss.name": "sspo",
                               "optim.lr/from_step_3": "1e-05"}

    updates = []
    wandb = object.__new__(WandbTracker)
    wandb.run = SimpleNamespace(config=SimpleNamespace(update=lambda d, allow_val_change: updates.append(
        (d, allow_val_change))))
    wandb._params = {"optim": {"lr": 1e-5, "weight_decay": 0.0}, "loss": {"name": "sspo"}}
    wandb.log_changes(2, {"optim.lr": (2e-5, 1e-5)})
    assert updates == [({"optim": {"lr": 1e-5, "weight_decay": 0.0}}, True)]
