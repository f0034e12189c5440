"""``rollout.schedule.placement: colocated``: the training ranks generate with their own engines.

With ``rollout.schedule.max_staleness = k`` up to k + 1 steps' rollouts are in flight
(:class:`~nemo_sspo.rollouts.staleness.LockStepRollouts`): step t trains on the rollout generated
with the weights of step t - 1 - k. After every update the weights stream into the engine bucket by
bucket, gathered on the replica's generating rank (its other model-parallel ranks run their share of
the gathers and load nothing).
"""

from __future__ import annotations

from nemo_sspo.megatron import WeightExporter
from nemo_sspo.rollout.refit_check import load_verified
from nemo_sspo.rollouts.producer import RolloutProducer
from nemo_sspo.rollouts.source import RefitOutcome, SourceFigures, StepRollout
from nemo_sspo.rollouts.staleness import LockStepRollouts, version_lag_sums

__all__ = ["ColocatedSource"]


class ColocatedSource:
    """The colocated mode (module docstring; :class:`~nemo_sspo.rollouts.RolloutSource`).

    Args:
        producer: the replica's rollout producer (generates with the engine's current weights;
            collective over the replica).
        exporter: the policy's weights, gathered on the generating rank (collective over the
            replica's model-parallel ranks).
        engine: this rank's rollout engine, or None on ranks that do not generate.
        max_staleness: k >= 0 (``rollout.schedule.max_staleness``).
        last_step: ``trainer.max_steps`` (nothing is generated beyond it).
        verify_refit: check every refit (``rollout.refit.verify``; the engine needs ``read_weights``).
    """

    rollout_gpus = None

    def __init__(self, producer: RolloutProducer, exporter: WeightExporter, engine, *, max_staleness: int,
                 last_step: int, verify_refit: bool) -> None:  # noqa: D107 - documented on the class
        self.producer, self.exporter, self.engine = producer, exporter, engine
        self.loaded_bytes = 0  # what the last push_weights loaded into the engine
        self.max_staleness, self.verify_refit = max_staleness, verify_refit
        self.in_flight = LockStepRollouts(max_staleness, last_step)
        self.version = 0  # the step whose update the trainer's weights hold (named by the refit check)

    def start(self, completed_steps: int, problems_drawn: int, positions=None) -> None:
        """A resumed run's engine takes the restored weights (a fresh one holds the initial weights)."""
        self.version = completed_steps
        if completed_steps > 0:
            self.push_weights()

    def rollout_positions(self) -> None:
        """None: the trainer's data position is the whole of it."""
        return None

    def next_rollout(self, step: int) -> StepRollout:
        """The rollout of step ``step`` (generated now, or k steps ago); the engine then sleeps
        (e.g. ``rollout.engine.options.enable_sleep_mode``: its memory freed until the refit).
        """
        versioned = self.in_flight.take(step, lambda ahead: self.producer.produce(ahead, step - 1))
        if self.engine is not None:
            self.engine.sleep()
        return StepRollout(versioned)

    def push_weights(self) -> None:
        """Streams the current weights into the engine (collective over the replica), checked with
        ``verify_refit`` (RuntimeError naming the step and the first differing weight); ``loaded_bytes``
        then holds the bytes the engine loaded (0 on the replica's other ranks).
        """
        self.loaded_bytes = 0

        def counted(buckets):
            for bucket in buckets:  # a tied head is the embeddings' own tensor: counted once
                self.loaded_bytes += sum({id(t): t.numel() * t.element_size() for t in bucket.values()}.values())
                yield bucket

        buckets = counted(self.exporter.buckets())
        if self.engine is not None and self.verify_refit:
            load_verified(self.engine, buckets, step=self.version)
        elif self.engine is not None:
            self.engine.load_weight_buckets(buckets)
        else:
            for _ in buckets:  # yields nothing here; runs this rank's gathers and sends
                pass

    def after_update(self, step: int) -> RefitOutcome:
        """The refit: the engine holds the weights after step ``step`` from here on (no weight byte goes
        to the host: ``bytes_to_host`` 0).
        """
        self.version = step
        self.push_weights()
        return RefitOutcome(None, bytes_to_host=0, bytes=self.loaded_bytes)

    def figures(self, step: int, got: StepRollout, generation_wait_s: float, refit: RefitOutcome) -> SourceFigures:
        """The version lag under lock-step staleness (k > 0); the generation window on the training ranks' lane."""
        pairs = version_lag_sums(got.versioned, step) if self.max_staleness > 0 else {}
        return SourceFigures(pairs, {}, [("training ranks", "generation", got.versioned.generated)], wait_phase=None)
