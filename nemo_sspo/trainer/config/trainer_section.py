"""``trainer`` (with ``trainer.wandb`` and ``trainer.mlflow``): steps, updates per step, seed, outputs,
checkpoints, resume and the trackers, with the section's own invariants.
"""

from __future__ import annotations

import importlib.util
import math
import os

from dataclasses import dataclass, field

from nemo_sspo.choice import Choice
from nemo_sspo.trainer.config.keyed import failed

__all__ = ["LOGGERS", "MlflowConfig", "TrainerConfig", "WandbConfig", "WandbMode"]

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
"""Names ``trainer.loggers`` takes (``nemo_sspo.trainer.metric_log``)."""


class WandbMode(Choice):
    """Values of ``trainer.wandb.mode`` (:attr:`WandbConfig.mode`)."""

    offline = "offline"
    online = "online"


@dataclass
class WandbConfig:
    """``trainer.wandb``: the Weights & Biases run (``wandb`` in ``trainer.loggers``)."""

    project: str = "nemo_sspo"
    """W&B project of the run."""
    entity: str | None = None
    """W&B entity (user or team); null = the account's default."""
    name: str | None = None
    """Run name; null = the last folder of ``trainer.output_dir``."""
    mode: WandbMode = WandbMode.offline
    """``offline``: a local run folder under ``output_dir/wandb/`` that ``wandb sync`` uploads later
    (nothing needs a network or an account); ``online``: streams to the W&B server (``wandb login`` first)."""


@dataclass
class MlflowConfig:
    """``trainer.mlflow``: the MLflow run (``mlflow`` in ``trainer.loggers``)."""

    tracking_uri: str | None = None
    """MLflow tracking store; null = a local SQLite store ``sqlite:///<output_dir>/mlflow.db`` with artifacts
    in ``output_dir/mlflow_artifacts`` (browse with ``mlflow ui --backend-store-uri <that uri>``); or a
    server such as ``http://host:5000``."""
    experiment: str = "nemo_sspo"
    """Experiment the run is filed under (created when missing)."""
    run_name: str | None = None
    """Run name; null = the last folder of ``trainer.output_dir``."""


_TRACKER_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}
"""Logger name -> (module imported, package installed) of the trackers that need a package."""


@dataclass
class TrainerConfig:
    """``trainer``: steps, updates per step, seed, outputs, checkpoints and resume."""

    max_steps: int = 12
    """Training steps; each is one rollout of prompts_per_step x samples_per_prompt responses."""
    minibatches_per_step: int = 2
    """Optimizer steps per rollout. Above 1, later mini-batches are off-policy (ratio != 1), so clipping is active."""
    seed: int = 1234
    """Seeds data sampling, generation and model-parallel RNG."""
    output_dir: str = "outputs/sspo_smollm2_cpu"
    """metrics.jsonl, TensorBoard events, the reward/entropy plot and checkpoints go here."""
    overwrite_output_dir: bool = False
    """Start over in an ``output_dir`` holding an earlier run: deletes that run's outputs (metrics,
    TensorBoard events, checkpoints, model folders, summaries, the trackers' local runs:
    ``nemo_sspo.trainer.checkpoint.RUN_OUTPUTS``) before the first step; a folder without the run's
    composed ``config.yaml`` (or the home folder) is refused, nothing deleted. Without it such a
    folder is refused (continue it with ``resume=auto``)."""
    save_hf_checkpoint: bool = True
    """Write the final policy as a Hugging Face checkpoint to ``output_dir/hf_checkpoint`` (also on a crash)."""
    checkpoint_interval: int = 0
    """Save a resumable checkpoint (policy, optimizer, SPPO critic, data position, RNG states) every N
    steps and at the last step, to ``output_dir/checkpoints/step_<N>`` (``nemo_sspo.trainer.checkpoint``);
    0 = never."""
    keep_checkpoints: int = 2
    """Resumable checkpoints kept on disk (the newest); older ones are deleted after a save. 0 = keep all."""
    resume: str | None = None
    """Resume from a checkpoint: a ``step_<N>`` folder, a ``checkpoints`` folder (its ``latest``), or
    ``auto`` (``output_dir/checkpoints/latest`` if it exists, else start fresh); null = start fresh.
    The checkpoint's ``config.yaml`` must match this run's on the model, parallel layout and world
    size, batch shape, data and seed (``nemo_sspo.trainer.run_config.RESUME_KEYS``); a resume that
    differs is refused with the keys."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Where per-step metrics go (``nemo_sspo.trainer.metric_log``), any of ``console`` (progress bar and
    one line per step), ``jsonl`` (``output_dir/metrics.jsonl``; resuming needs it), ``tensorboard``
    (``output_dir/tensorboard/``), ``wandb`` (``trainer.wandb``) and ``mlflow`` (``trainer.mlflow``). W&B
    and MLflow also get the composed config as parameters and the reward/entropy plot."""
    progress_interval_s: float = 15.0
    """Progress inside a step on the console (``nemo_sspo.trainer.progress``): a phase line (generation
    with the responses done, scoring, old and reference log-probs, the update's optimizer steps and
    micro-batches, refit, checkpoint save) at most every this many seconds, none for a shorter step; 0 = none."""
    rollout_log: bool = False
    """Write one JSON Lines record per response per step (prompt and response text, task and shaped
    reward, advantage, length, version, truncation) to ``output_dir/rollouts/replica_<dp rank>.jsonl``
    (``nemo_sspo.trainer.rollout_log``); kept and replaced on resume like ``metrics.jsonl``. About the
    responses' text per step: ~12 MB at 1,024 responses of 3,000 tokens."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases run settings, used when ``wandb`` is in ``trainer.loggers``."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow run settings, used when ``mlflow`` is in ``trainer.loggers``."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB for the memory plan checked at load (``nemo-sspo plan``); null = the
    visible device's (no check on a host without a GPU)."""
    skip_memory_check: bool = False
    """Start even when the memory plan's peak exceeds ``gpu_memory_gib``."""

    def problems(self, key: str) -> list[str]:
        """Step counts, intervals, the output folder, the loggers (names, the W&B mode, the trackers'
        packages) and resume's need of ``jsonl``.

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        unknown = [name for name in self.loggers if name not in LOGGERS]
        return failed(
            (self.checkpoint_interval >= 0, f"{key}.checkpoint_interval must be >= 0 (0 disables checkpoints)"),
            (self.keep_checkpoints >= 0, f"{key}.keep_checkpoints must be >= 0 (0 keeps every checkpoint)"),
            (self.max_steps >= 1, f"{key}.max_steps must be >= 1"),
            (0 <= self.progress_interval_s < math.inf,
             f"{key}.progress_interval_s={self.progress_interval_s} must be seconds >= 0 (0 prints no phase lines)"),
            (self.gpu_memory_gib is None or 0 < self.gpu_memory_gib < math.inf,
             f"{key}.gpu_memory_gib={self.gpu_memory_gib} must be one GPU's memory in GiB (> 0, e.g. 80 for an "
             "H100), or null for the visible GPU's"),
            (not os.path.exists(self.output_dir) or os.path.isdir(self.output_dir),
             f"{key}.output_dir={self.output_dir!r} is an existing file, not a folder: choose another "
             f"{key}.output_dir"),
            (self.minibatches_per_step >= 1, f"{key}.minibatches_per_step must be >= 1"),
            (not unknown, f"{key}.loggers has unknown names {unknown}; valid: {', '.join(LOGGERS)}"),
            (len(set(self.loggers)) == len(self.loggers), f"{key}.loggers={list(self.loggers)} names a logger twice"),
            (self.resume is None or "jsonl" in self.loggers,
             f"{key}.resume={self.resume!r} needs 'jsonl' in {key}.loggers: the resumed run keeps the earlier "
             "steps' records from output_dir/metrics.jsonl"),
            *((name not in self.loggers or importlib.util.find_spec(module) is not None,
               f"{key}.loggers has {name!r} but the package {package} is not installed: run `bash install.sh` "
               f"(or pip install --no-deps -r constraints/trackers.txt), or remove {name!r} from {key}.loggers")
              for name, (module, package) in _TRACKER_PACKAGES.items()),
        )
