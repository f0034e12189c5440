"""Experiment trackers beside the local files: Weights & Biases and MLflow.

Each tracker gets every step's metrics, the composed config as parameters once at the start, and
the reward/entropy plot at the end. Both are imported only when selected in ``trainer.loggers``
(config validation checks they are installed). The run ids are kept in ``output_dir/trackers.json``.

Resuming (docs/pitfalls.md#tracker-resume-steps). A resumed run whose checkpoint is the last step
the trackers hold continues the same W&B and MLflow runs. A resumed run that re-runs steps the
trackers already hold (a run killed after step 3 and resumed from the step-2 checkpoint) cannot
continue them: W&B keeps the first value logged at a step and drops any later log at a step <= the
run's last, and MLflow keeps every value of a step (its history then has two values at step 3).
W&B's server-side rewind (``resume_from="<id>?_step=<n>"``) would do it, but it needs the W&B server
when the run starts, and our runs are offline by default. So such a resume starts a new tracker
run (a :class:`Branch`) that names its parent (W&B config ``resumed_from``, MLflow tags
``resumed_from_run`` / ``resumed_from_step``) and first re-logs the kept steps
from ``metrics.jsonl``: the new run alone holds exactly one value per step, the resumed run's. The
parent stays as it was (MLflow: tagged ``superseded_by`` and marked KILLED), and
``trackers.json`` names the new run, which later resumes continue.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Branch", "MlflowTracker", "RESUMED_FROM", "WandbTracker", "flatten_params"]

RUN_IDS_FILE = "trackers.json"
RESUMED_FROM = "resumed_from"
"""W&B config key of a branched run: ``{"run_id": <parent id>, "step": <checkpoint step>}``."""


@dataclass(frozen=True)
class Branch:
    """A resume from the checkpoint of ``step`` when the trackers' runs already hold later steps.

    Attributes:
        step: the checkpoint's step (the parent's values after it are abandoned).
        records: the kept per-step records (``{"step": n, key: value, ...}``, steps 1..``step``
            from ``metrics.jsonl``), re-logged into the new run first.
    """

    step: int
    records: list[dict[str, float]] = field(default_factory=list)


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted-key strings of a nested config dict (``{"trainer": {"seed": 1}}`` -> ``{"trainer.seed": "1"}``).

    Args:
        config: nested dict of plain values (lists are kept as one value).
        prefix: key path of ``config`` itself.

    Returns:
        Flat ``{key path: str(value)}``, in the dict's order.
    """
    flat: dict[str, str] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_params(value, prefix=f"{path}."))
        else:
            flat[path] = str(value)
    return flat


def _run_ids(output_dir: Path) -> dict[str, str]:
    path = output_dir / RUN_IDS_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _save_run_id(output_dir: Path, name: str, run_id: str) -> None:
    ids = {**_run_ids(output_dir), name: run_id}
    (output_dir / RUN_IDS_FILE).write_text(json.dumps(ids, indent=1) + "\n", encoding="utf-8")


class WandbTracker:
    """A W&B run (offline by default: ``output_dir/wandb/offline-run-*``, uploaded by ``wandb sync``).

    Args:
        output_dir: the run's output folder (the W&B folder goes under it).
        cfg: ``trainer.wandb`` (a ``WandbConfig``).
        params: the composed config as a nested dict.
        resume: continue the run recorded in ``trackers.json`` (a resumed training run).
        branch: with ``resume``, the run holds steps after the checkpoint: start a new run naming
            the recorded one as its parent and re-log ``branch.records`` (module docstring).
    """

    def __init__(self, output_dir: Path, cfg, params: dict[str, Any], *, resume: bool,
                 branch: Branch | None = None) -> None:
        """Starts (or, resuming, continues or branches) the run (class docstring)."""
        import wandb

        self._wandb = wandb
        parent = _run_ids(output_dir).get("wandb") if resume else None
        run_id = parent if branch is None else None
        config = params if branch is None or parent is None else {
            **params, RESUMED_FROM: {"run_id": parent, "step": branch.step}}
        # console="off": W&B must not wrap stdout/stderr, which the progress bar and step lines use.
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or output_dir.name,
                              mode=cfg.mode, dir=str(output_dir), config=config, id=run_id,
                              resume="allow" if run_id else None, settings=wandb.Settings(console="off"))
        _save_run_id(output_dir, "wandb", self.run.id)
        self._params = params
        for record in branch.records if branch is not None else ():
            self.log(int(record["step"]), {k: v for k, v in record.items() if k != "step"})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Records ``metrics`` at ``step``."""
        self.run.log(metrics, step=step)

    def log_changes(self, step: int, changes: dict[str, tuple]) -> None:
        """A resume's allowed config changes (``{dotted key: (old, new)}``; ``step``: the step resumed
        after): the run's config gets the current values of the sections they touch.
        """
        sections = {key.split(".", 1)[0] for key in changes}
        self.run.config.update({name: self._params[name] for name in sections if name in self._params},
                               allow_val_change=True)

    def close(self, plot: Path | None, last_step: int | None) -> None:
        """Adds the plot (as ``plots/reward_entropy`` at the last step) and finishes the run."""
        if plot is not None and last_step is not None:
            self.run.log({"plots/reward_entropy": self._wandb.Image(str(plot))}, step=last_step)
        self.run.finish()


class MlflowTracker:
    """An MLflow run through ``MlflowClient`` (no global active-run state).

    Args:
        output_dir: the run's output folder (the default local store and its artifacts go there).
        cfg: ``trainer.mlflow`` (an ``MlflowConfig``).
        params: the composed config as a nested dict (logged flattened, ``trainer.seed`` etc.).
        resume: continue the run recorded in ``trackers.json``.
        branch: with ``resume``, the run holds steps after the checkpoint: create a new run tagged
            with its parent, tag the parent ``superseded_by`` (status KILLED) and re-log
            ``branch.records`` (module docstring).
    """

    _BATCH = 100  # MLflow's limit of params per log_batch call
    _METRIC_BATCH = 1000  # and of metrics

    def __init__(self, output_dir: Path, cfg, params: dict[str, Any], *, resume: bool,
                 branch: Branch | None = None) -> None:
        """Creates (or, resuming, reopens or branches) the run and logs the parameters once (class docstring)."""
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self._metric = Metric
        local = cfg.tracking_uri is None
        uri = f"sqlite:///{output_dir.resolve() / 'mlflow.db'}" if local else cfg.tracking_uri
        self.client = MlflowClient(tracking_uri=uri)
        parent = _run_ids(output_dir).get("mlflow") if resume else None
        if parent is not None and branch is None:
            run_id = parent
            self.client.update_run(run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(cfg.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None else self.client.create_experiment(
                cfg.experiment,
                artifact_location=(output_dir.resolve() / "mlflow_artifacts").as_uri() if local else None))
            tags = {} if parent is None else {"resumed_from_run": parent,
                                              "resumed_from_step": str(branch.step)}
            run_id = self.client.create_run(experiment_id, run_name=cfg.run_name or output_dir.name,
                                            tags=tags).info.run_id
            flat = [Param(key, value) for key, value in flatten_params(params).items()]
            for start in range(0, len(flat), self._BATCH):
                self.client.log_batch(run_id, params=flat[start:start + self._BATCH])
            if parent is not None:
                self.client.set_tag(parent, "superseded_by", run_id)
                self.client.set_terminated(parent, status="KILLED")
        self.run_id, self.tracking_uri = run_id, uri
        _save_run_id(output_dir, "mlflow", run_id)
        if branch is not None:
            now = int(time.time() * 1000)
            kept = [self._metric(key, float(value), now, int(record["step"]))
                    for record in branch.records for key, value in record.items() if key != "step"]
            for start in range(0, len(kept), self._METRIC_BATCH):
                self.client.log_batch(run_id, metrics=kept[start:start + self._METRIC_BATCH])

    def log_changes(self, step: int, changes: dict[str, tuple]) -> None:
        """A resume's allowed config changes (``{dotted key: (old, new)}``; ``step``: the step resumed
        after). MLflow parameters cannot change, so each new value is logged as the parameter
        ``<key>/from_step_<step + 1>`` (``optim.lr/from_step_3``) beside the original ``<key>``; a
        name already taken with another value (a second resume from the same step) becomes a tag.
        """
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        params = [Param(f"{key}/from_step_{step + 1}", str(new)) for key, (_, new) in changes.items()]
        try:
            self.client.log_batch(self.run_id, params=params)
        except MlflowException:
            for param in params:
                self.client.set_tag(self.run_id, param.key, param.value)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Records ``metrics`` at ``step`` (one batch call)."""
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(key, float(value), now, step)
                                                    for key, value in metrics.items()])

    def close(self, plot: Path | None, last_step: int | None) -> None:
        """Uploads the plot as an artifact and marks the run finished."""
        if plot is not None:
            self.client.log_artifact(self.run_id, str(plot))
        self.client.set_terminated(self.run_id)
