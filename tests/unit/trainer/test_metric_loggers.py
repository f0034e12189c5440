"""trainer.loggers: every selected logger gets the same per-step values, read back with each
tracker's own reader; W&B and MLflow also get the composed config and the plot; after a kill and a
resume every tracker holds one value per step (docs/pitfalls.md#tracker-resume-steps)."""

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


RESUMED = {3: {"reward/mean": 0.5, "timing/step_s": 5.0, "throughput/mfu": 0.0625},
           4: {"reward/mean": 0.0, "timing/step_s": 1.0, "throughput/mfu": 1.0},
           5: {"reward/mean": 0.125, "timing/step_s": 3.0, "throughput/mfu": 0.5}}
_KILLED_RUN = """
import os, signal, sys
from nemo_sspo.trainer.config import TrainerConfig
from nemo_sspo.trainer.metric_log import MetricsLogger
out, steps = sys.argv[1], {steps!r}
log = MetricsLogger(out, 3, enabled=True, trainer=TrainerConfig(loggers={loggers!r}, output_dir=out),
                    params={params!r})
for step in (1, 2, 3):
    log.log(step, steps[step])
os.kill(os.getpid(), signal.SIGKILL)  # killed after step 3: nothing closed
"""
PARAMS = {"trainer": {"seed": 7, "loggers": ALL}, "loss": {"name": "sspo"}}


def _resume(out, steps, resume_step):
    log = MetricsLogger(out, 5, enabled=True, resume_step=resume_step, trainer=TrainerConfig(loggers=ALL, output_dir=str(out)),
                        params=PARAMS)
    for step in steps:
        log.log(step, RESUMED[step])
    log.close()
    return log


@pytest.mark.slow
def test_after_a_kill_and_a_resume_every_tracker_holds_one_value_per_step(tmp_path, capsys):
    """Killed (SIGKILL) after step 3, resumed from the step-2 checkpoint: every logger, read back with
    its own reader, holds steps 1-2 of the first run and the resumed run's 3 and 4, once each; a
    second resume from step 4 (nothing abandoned) continues the same tracker runs."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    script = _KILLED_RUN.format(steps=STEPS, loggers=ALL, params=PARAMS)
    killed = subprocess.run([sys.executable, "-c", script, str(out)], env={**os.environ, "WANDB_SILENT": "true"},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    parent_ids = json.loads((out / "trackers.json").read_text())
    log = _resume(out, [3, 4], resume_step=2)
    expected = [(1, 0.25), (2, 0.75), (3, 0.5), (4, 0.0)]  # 1, 2 from STEPS; 3, 4 from RESUMED

    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in jsonl] == expected
    assert tensorboard_scalars(out / "tensorboard", "reward/mean") == expected

    # W&B: a new run (W&B drops a second log at a step it holds) naming its parent, holding every step once.
    ids = json.loads((out / "trackers.json").read_text())
    assert ids["wandb"] != parent_ids["wandb"] and ids["mlflow"] != parent_ids["mlflow"]
    (run_dir,) = (out / "wandb").glob(f"offline-run-*-{ids['wandb']}")
    rows, config = wandb_history(run_dir)
    assert [(r["_step"], r["reward/mean"]) for r in rows if "reward/mean" in r] == expected
    assert config["resumed_from"] == {"run_id": parent_ids["wandb"], "step": 2}
    assert config["trainer"] == {"seed": 7, "loggers": ALL} and config["loss"] == {"name": "sspo"}
    (image,) = [r for r in rows if "plots/reward_entropy/path" in r]
    assert image["_step"] == 4 and image["plots/reward_entropy/format"] == "png"
    assert (run_dir / "files" / image["plots/reward_entropy/path"]).stat().st_size == (out / "reward_entropy.png").stat().st_size

    # MLflow: the new run holds every step once; the parent keeps its abandoned step 3, marked.
    client, _ = mlflow_runs(out)
    run = client.get_run(ids["mlflow"])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")] == expected
    assert run.data.params == {"trainer.seed": "7", "trainer.loggers": str(ALL), "loss.name": "sspo"}
    assert (run.data.tags["resumed_from_run"], run.data.tags["resumed_from_step"]) == (
        parent_ids["mlflow"], "2")
    parent = client.get_run(parent_ids["mlflow"])
    assert parent.data.tags["superseded_by"] == ids["mlflow"] and parent.info.status == "KILLED"
    assert (3, 1.0) in [(m.step, m.value) for m in client.get_metric_history(parent.info.run_id, "reward/mean")]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["reward_entropy.png"]

    # The summary leaves out step 1 (one-time costs): means of steps 2-4 = (2 + 5 + 1) / 3 and (0.25 + 0.0625 + 1) / 3.
    assert log.summary["summary/timing/step_s"] == pytest.approx(8 / 3)
    assert log.summary["summary/throughput/mfu"] == pytest.approx(1.3125 / 3)
    assert json.loads((out / "throughput_summary.json").read_text()) == log.summary
    assert "run summary: throughput/mfu=0.4375" in capsys.readouterr().out

    # A resume from the last step (nothing abandoned) continues the same W&B and MLflow runs.
    _resume(out, [5], resume_step=4)
    assert json.loads((out / "trackers.json").read_text()) == ids
    expected.append((5, 0.125))
    # W&B names a continued run's folder offline-run-<start second>-<id>, with "-1" appended when that
    # name is taken (both segments started within one second: on a loaded machine they do).
    rows = [row for folder in sorted((out / "wandb").glob(f"offline-run-*-{ids['wandb']}*"))
            for row in wandb_history(folder)[0] if "reward/mean" in row]
    assert [(r["_step"], r["reward/mean"]) for r in rows] == expected
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "reward/mean")] == expected
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"
    assert tensorboard_scalars(out / "tensorboard", "reward/mean") == expected


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
