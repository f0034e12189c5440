"""Per-step metric output to the loggers that ``trainer.loggers`` selects.

``console`` (a progress bar and one line per step), ``jsonl`` (``metrics.jsonl``), ``tensorboard`` (events under ``tensorboard/``),
``wandb`` and ``mlflow`` (:mod:`nemo_sspo.trainer.trackers`). At the end: a reward/entropy plot
(``reward_entropy.png``, also sent to the trackers) and the run's throughput summary
(:func:`nemo_sspo.trainer.throughput.summarize_throughput`: printed, written to
``throughput_summary.json`` and sent to the trackers). Only the logging rank writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm.auto import tqdm

from nemo_sspo.data.jsonl import jsonl_lines
from nemo_sspo.trainer.config import TrainerConfig
from nemo_sspo.trainer.throughput import summarize_throughput
from nemo_sspo.trainer.trackers import Branch, MlflowTracker, WandbTracker

__all__ = ["MetricsLogger", "SUMMARY_KEYS", "plot_metrics"]

# Shown on the console line, in this order (all keys still go to jsonl/TensorBoard).
SUMMARY_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/accuracy", "acc", "{:.3f}"),
    ("response/length_mean", "len", "{:.1f}"),
    ("policy/entropy", "H", "{:.3f}"),
    ("policy/clipfrac_tokens", "clip_tok", "{:.4f}"),
    ("policy/clipfrac_segments", "clip_seg", "{:.4f}"),
    ("policy/b_low", "b_low", "{:.3f}"),
    ("policy/b_high", "b_high", "{:.3f}"),
    ("policy/segments_per_response", "seg/resp", "{:.2f}"),
    ("optim/grad_norm", "gnorm", "{:.3f}"),
    ("rollout/sampling_rounds", "rounds", "{:.0f}"),
    ("critic/value_mean", "V", "{:.3f}"),
    ("timing/generation_s", "gen_s", "{:.1f}"),
    ("timing/train_s", "train_s", "{:.1f}"),
    ("throughput/tokens_per_s_per_gpu", "tok/s/gpu", "{:.0f}"),
    ("throughput/mfu", "mfu", "{:.3f}"),
)
_TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def _format_line(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step:>3}"]
    for key, short, fmt in SUMMARY_KEYS:
        if key in metrics:
            parts.append(f"{short}={fmt.format(metrics[key])}")
    return " ".join(parts)


class MetricsLogger:
    """Writes one record per training step to the selected loggers.

    Args:
        output_dir: folder for ``metrics.jsonl``, ``tensorboard/``, the trackers' local folders and
            ``reward_entropy.png``.
        total_steps: length of the progress bar.
        enabled: False on every rank but the logging one (nothing is written or shown).
        resume_step: continue a run resumed after this step: the records of steps up to it are kept
            (in ``history`` too, for the plot), later ones (written after the checkpoint by the
            interrupted run) are dropped, from ``metrics.jsonl`` and, via ``purge_step``, from
            TensorBoard. W&B and MLflow continue their runs when ``metrics.jsonl`` ends at this
            step; when it holds later steps, they start new runs naming the earlier ones, holding
            the kept steps first (:class:`nemo_sspo.trainer.trackers.Branch`), so every logger has
            one value per step. None starts a new ``metrics.jsonl``.
        trainer: the ``trainer`` section: ``loggers``, ``wandb``, ``mlflow`` (None: its defaults).
        params: the composed config as a nested dict, sent to W&B and MLflow as parameters.
    """

    def __init__(self, output_dir: str | Path, total_steps: int, *, enabled: bool,
                 resume_step: int | None = None, trainer: TrainerConfig | None = None,
                 params: dict | None = None) -> None:
        """Opens the selected loggers (class docstring); nothing when not ``enabled``."""
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.history: list[dict[str, float]] = []
        self.summary: dict[str, float] = {}
        if not enabled:
            return
        trainer = trainer or TrainerConfig()
        self.loggers = tuple(trainer.loggers)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / "metrics.jsonl"
        branch = None
        if resume_step is not None:
            records = _records(path)
            self.history = [r for r in records if r["step"] <= resume_step]
            if any(r["step"] > resume_step for r in records):  # the trackers hold abandoned steps
                branch = Branch(resume_step, self.history)
        self._jsonl = self._tb = self._bar = None
        if "jsonl" in self.loggers:
            self._jsonl = open(path, "w", encoding="utf-8")
            for record in self.history:
                self._jsonl.write(json.dumps(record) + "\n")
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=purge)
        if "console" in self.loggers:
            self._bar = tqdm(total=total_steps, initial=resume_step or 0, desc="train", unit="step",
                             dynamic_ncols=True)
        self._trackers = [
            _TRACKERS[name](self.output_dir, getattr(trainer, name), params or {}, resume=resume_step is not None,
                            branch=branch)
            for name in self.loggers if name in _TRACKERS]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Records ``metrics`` (flat name -> float) for ``step`` (1-based)."""
        self.history.append({"step": step, **metrics})
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        for tracker in self._trackers:
            tracker.log(step, metrics)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(reward=f"{metrics.get('reward/mean', math.nan):.3f}")
            self._bar.write(_format_line(step, metrics))

    def log_config_changes(self, step: int, changes: dict[str, tuple]) -> None:
        """Sends the settings a resumed run changed (allowed on resume) to the trackers, whose
        parameters otherwise still hold the checkpoint's values (MLflow's cannot change).

        Args:
            step: the step the run resumed after (its next record is ``step + 1``).
            changes: ``{dotted config key: (checkpoint value, value now)}``
                (:func:`nemo_sspo.trainer.run_config.resume_changes`).
        """
        if not self.enabled or not changes:
            return
        for tracker in self._trackers:
            tracker.log_changes(step, changes)

    def close(self) -> None:
        """Writes the summary and the plot, sends both to the trackers, closes everything.

        The trackers and files are closed even when the plot fails (its error then propagates), so a
        W&B or MLflow run never stays open.
        """
        if not self.enabled:
            return
        plot = last_step = None
        try:
            if self.history:
                last_step = self.history[-1]["step"]
                self.summary = summarize_throughput(self.history)
                if self.summary:
                    (self.output_dir / "throughput_summary.json").write_text(
                        json.dumps(self.summary, indent=1) + "\n", encoding="utf-8")
                plot_metrics(self.history, self.output_dir / "reward_entropy.png")
                plot = self.output_dir / "reward_entropy.png"
        finally:
            self._close_loggers(plot, last_step)

    def _close_loggers(self, plot: Path | None, last_step: int | None) -> None:
        for tracker in self._trackers:
            if self.summary:
                tracker.log(last_step, self.summary)
            tracker.close(plot, last_step)
        if self._bar is not None:
            self._bar.close()
            if self.summary:
                print("run summary: " + " ".join(f"{key.removeprefix('summary/')}={value:.4g}"
                                                 for key, value in self.summary.items()), flush=True)
        for handle in (self._tb, self._jsonl):
            if handle is not None:
                handle.close()


def _records(path: Path) -> list[dict[str, float]]:
    """The records of ``path`` (metrics.jsonl) in file order; none if the file is missing."""
    if not path.is_file():
        return []
    return [json.loads(line) for _, line in jsonl_lines(path.read_text(encoding="utf-8"))]


def plot_metrics(history: list[dict[str, float]], path: Path) -> None:
    """Saves a two-panel PNG of mean reward and mean token entropy over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [h["step"] for h in history]
    fig, (ax_r, ax_h) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_r.plot(steps, [h.get("reward/mean", math.nan) for h in history], marker="o", ms=3)
    ax_r.set(xlabel="step", ylabel="mean reward", title="Reward")
    ax_h.plot(steps, [h.get("policy/entropy", math.nan) for h in history], marker="o", ms=3, color="C1")
    ax_h.set(xlabel="step", ylabel="nats / token", title="Token entropy (old policy)")
    for ax in (ax_r, ax_h):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
