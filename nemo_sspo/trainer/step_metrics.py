"""One step's figures: the phase timer, the timeline, the step observers and the metric reduction.

The recipe (:mod:`nemo_sspo.trainer.loop`) times its phases with :meth:`StepMetrics.phase`, tells
the step's observers what each phase produced (:meth:`StepMetrics.observe`), hands over the metric
pairs and values it gets from its parts, and ends the step with :meth:`StepMetrics.finish`, which
adds the rollout source's figures (:class:`nemo_sspo.rollouts.source.SourceFigures`), the rollout
and throughput metrics, reduces everything over the data-parallel and pipeline ranks (the same
values on every rank) and draws the step on the timeline.

A step observer is any callable ``observer(step, event, data)``; the events, in order:

- ``"rollout"``: the :class:`~nemo_sspo.rollouts.source.StepRollout` the step trains on;
- ``"advantages"``: ``(versioned rollout, [B] float32 advantages)``;
- ``"batch"``: the prepared :class:`~nemo_sspo.algorithms.batch.PolicyBatch` (old log-probs in);
- ``"update"``: ``(the loss's metric pairs, mean gradient norm)``;
- ``"refit"``: the :class:`~nemo_sspo.rollouts.source.RefitOutcome`;
- ``"metrics"``: the step's reduced metrics.

The rollout log is one (:class:`nemo_sspo.trainer.rollout_log.RolloutLog`); tests record with them
instead of patching the trainer's methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from nemo_sspo.algorithms.off_policy import effective_sample_size
from nemo_sspo.megatron import ParallelGroups
from nemo_sspo.metrics import MetricPair
from nemo_sspo.parallel.metric_reduce import collective_device, reduce_metric_sums
from nemo_sspo.rollouts.source import RefitOutcome, RolloutSource, StepRollout
from nemo_sspo.trainer.rollout_metrics import rollout_metric_sums
from nemo_sspo.trainer.throughput import ModelShape, step_work_sums, throughput_metrics
from nemo_sspo.trainer.timeline import Timeline

__all__ = ["StepMetrics", "StepObserver"]

StepObserver = Callable[[int, str, Any], None]
"""``observer(step, event, data)`` (module docstring)."""

TRAINING_LANE = "training ranks"
"""The timeline lane of the training ranks' phases."""


class StepMetrics:
    """The step's timer, timeline, observers and metric reduction (module docstring).

    Args:
        groups: this rank's parallel groups (the reductions' groups).
        samples_per_prompt: responses per prompt (``rollout.samples_per_prompt``).
        shaped_rewards: whether rewards carry overlong shaping (``reward.overlong_buffer_len > 0``).
        shape: the policy's shape (FLOP counts).
        forward_passes: passes over a step's tokens (old log-probs, reference log-probs, update).
        peak: the device's peak TFLOP/s, or None when unknown (no MFU).

    Attributes:
        timeline: every step's phase windows (written by the recipe's ``close``).
        observers: the step observers, called in order.
    """

    def __init__(self, groups: ParallelGroups, *, samples_per_prompt: int, shaped_rewards: bool, shape: ModelShape,
                 forward_passes: int, peak: float | None) -> None:  # noqa: D107
        self.groups, self.samples_per_prompt, self.shaped_rewards = groups, samples_per_prompt, shaped_rewards
        self.shape, self.forward_passes, self.peak = shape, forward_passes, peak
        self.timeline = Timeline()
        self.observers: list[StepObserver] = []
        self._step, self._start = 0, 0.0
        self._seconds: dict[str, float] = {}
        self._windows: dict[str, tuple[float, float]] = {}
        self._pairs: dict[str, MetricPair] = {}
        self._last_stage_pairs: dict[str, MetricPair] = {}
        self._values: dict[str, float] = {}

    def begin(self, step: int) -> None:
        """Starts step ``step``: clears the last step's figures and the device's peak memory."""
        self._step, self._start = step, time.perf_counter()
        self._seconds, self._windows, self._pairs, self._last_stage_pairs, self._values = {}, {}, {}, {}, {}
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    @contextmanager
    def phase(self, name: str):
        """Times the block as phase ``name`` (``timing/<name>_s``; its unix window for the timeline)."""
        start, wall = time.perf_counter(), time.time()
        yield
        self._seconds[f"timing/{name}_s"] = time.perf_counter() - start
        self._windows[name] = (wall, time.time())

    def observe(self, event: str, data: Any) -> Any:
        """Tells every observer what the step's phase ``event`` produced; returns ``data``."""
        for observer in self.observers:
            observer(self._step, event, data)
        return data

    def add(self, pairs: dict[str, MetricPair] | None = None, values: dict[str, float] | None = None, *,
            last_stage_pairs: dict[str, MetricPair] | None = None) -> None:
        """Adds metric ``pairs`` (reduced over data-parallel ranks), plain ``values`` (the same on every
        rank) and pairs kept only on the last pipeline stage (those of the batch, which only it reads).
        """
        self._pairs.update(pairs or {})
        self._values.update(values or {})
        self._last_stage_pairs.update(last_stage_pairs or {})

    def finish(self, got: StepRollout, source: RolloutSource, refit: RefitOutcome, batch) -> dict[str, float]:
        """The step's metrics (collective over the training ranks; the same on every rank, but
        ``refit/bytes``, which only the replicas' export ranks report).

        Args:
            got: the rollout the step trained on.
            source: the run's rollout source (its figures of the step).
            refit: what its ``after_update`` returned.
            batch: the step's prepared policy batch (the rollout metrics read its masks).

        Returns:
            Metric name -> value (module docstring of :mod:`nemo_sspo.trainer.metric_log` for the names).
        """
        g, values = self.groups, dict(self._values)
        got = replace(got, versioned=self._generation_window(got.versioned))
        figures = source.figures(self._step, got, self._seconds["timing/generation_s"], refit)
        if refit.seconds_per_gb is not None:
            values["timing/refit_s_per_gb"] = refit.seconds_per_gb
        if refit.bytes_to_host is not None:
            values["refit/bytes_to_host"] = float(refit.bytes_to_host)
        if refit.bytes is not None and g.mp_rank == 0:  # the export rank's count (the others export nothing)
            values["refit/bytes"] = float(refit.bytes)
        pairs = dict(self._pairs)
        if g.is_last_stage:
            rollout, rb = got.versioned.rollout, got.versioned.rollout.batch
            pairs.update(self._last_stage_pairs)
            pairs.update(figures.pairs)
            pairs.update(rollout_metric_sums(rollout, batch, samples_per_prompt=self.samples_per_prompt,
                                             shaped_rewards=self.shaped_rewards))
            pairs.update(step_work_sums(rb.prompt_mask.sum(1), rb.response_mask.sum(1), self.shape,
                                        forward_passes=self.forward_passes))
        metrics = reduce_metric_sums(pairs, dp_group=g.dp_group, pp_group=g.pp_group, last_stage_rank=g.pp_last_rank,
                                     is_last_stage=g.is_last_stage)
        ess = effective_sample_size(metrics)
        if ess is not None:
            metrics["rollout/is_ess"] = ess
        metrics.update(values)
        metrics.update(self._seconds)
        metrics["timing/step_s"] = time.perf_counter() - self._start
        generated = got.versioned.generated
        metrics["timing/rollout_generation_s"] = generated[1] - generated[0]
        metrics.update(throughput_metrics(metrics, dp_size=g.dp_size, training_gpus=dist.get_world_size(),
                                          rollout_gpus=source.rollout_gpus, peak=self.peak))
        if torch.cuda.is_available():
            metrics["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        metrics.update(figures.values)
        self._draw(figures.windows, figures.wait_phase)
        self.observe("metrics", metrics)
        return metrics

    def _generation_window(self, versioned):
        """``versioned`` with the generation window of the whole step over every generating rank (earliest
        start, latest end over the data-parallel replicas: their rollout ranks, or colocated the replicas
        themselves), so the rollout side's metrics are the same on every training rank.
        """
        if self.groups.dp_size == 1:
            return versioned
        window = torch.tensor([-versioned.generated[0], versioned.generated[1]], dtype=torch.float64)
        on_device = window.to(collective_device(None))
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=self.groups.dp_group)
        start, end = on_device.cpu().tolist()
        return replace(versioned, generated=(-start, end))

    def _draw(self, windows: list[tuple[str, str, tuple[float, float]]], wait_phase: str | None) -> None:
        """The rollout side's windows, then the training ranks' phases (the generation phase named
        ``wait_phase``, or left out when the training ranks generated: ``windows`` shows it).
        """
        for lane, phase, window in windows:
            self.timeline.add(lane, phase, self._step, *window)
        for phase, window in self._windows.items():
            if phase == "generation":
                if wait_phase is None:
                    continue
                phase = wait_phase
            self.timeline.add(TRAINING_LANE, phase, self._step, *window)

    def checkpoint_window(self, step: int, window: tuple[float, float]) -> None:
        """Draws step ``step``'s checkpoint save (unix seconds, start and end) on the training ranks' lane."""
        self.timeline.add(TRAINING_LANE, "checkpoint", step, *window)
