"""The GRPO-family training loop on a Megatron-Core policy.

One step reads top to bottom as named phases::

    sample prompts -> generate (rollout engine, current weights) -> score (the reward)
    [-> refill zero-variance groups: DAPO dynamic sampling] -> advantages (the estimator
    ``advantage.name``: group-relative, leave-one-out, batch std, r - sigmoid(V) from the SPPO critic,
    or a plug-in's) -> segment ids (the loss's segmentation) -> old (and
    reference) log-probs/entropy (Megatron, forward only) -> mini-batch updates -> critic update
    -> refit (Megatron -> rollout engine) -> metrics

Rollouts are generated one prompt group per ``generate`` call, seeded by (seed, step, sampling
round, global prompt index) (:mod:`nemo_sspo.rollouts.sampling`), so the samples do not depend on how
prompts are split over data-parallel ranks: the same seed and config give the same first step for
any TP x PP x DP layout. Within a data-parallel replica only the first model-parallel rank generates
and scores; it broadcasts the rollout to the replica's other TP/PP ranks.

What the loss config asks of the trainer (:class:`nemo_sspo.algorithms.losses.PolicyLossConfig`):
``segmentation`` / ``segment_k`` pick the segment ids; ``advantage_std_normalisation`` the group
advantage; DCPO's ``smooth_advantages`` mixes each prompt's group statistics with those of its
earlier visits (a per-prompt history kept identical on every rank and saved in checkpoints);
``kl_coef > 0`` keeps a frozen Megatron copy of the initial policy and adds its ``ref_logprobs`` to
the batch (nothing is built when it is 0). ``advantage.name`` (:mod:`nemo_sspo.algorithms.advantage_estimators`;
null resolves from the loss's ``advantage_source``) picks the advantage estimator; ``critic`` trains the
SPPO critic (:mod:`nemo_sspo.trainer.critic_training`).

Around the steps: ``rollout.correction`` multiplies each token's loss by an importance weight of
pi_old / pi_rollout, truncated or masked (:mod:`nemo_sspo.algorithms.off_policy`);
``rollout.max_staleness`` trains step t on a rollout generated k steps earlier
(:mod:`nemo_sspo.rollouts.staleness`), or with ``rollout.staleness_schedule: free`` on the next
received rollout at most k versions old (:mod:`nemo_sspo.rollouts.worker`);
``eval.every_n_steps`` evaluates the rollout engine's weights and keeps the best step
(:mod:`nemo_sspo.trainer.periodic_eval`);
``trainer.checkpoint_interval`` / ``trainer.resume`` save and restore the whole training state
(:mod:`nemo_sspo.trainer.checkpoint`). On a CUDA host the policy lives on the GPU and each
micro-batch is moved there in the forward step; whole batches stay on the host
(:mod:`nemo_sspo.trainer.device`).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_sspo.algorithms import (
    PromptRewardStats,
    segment_ids,
    zero_variance_groups,
)
from nemo_sspo.algorithms.advantage_estimators import AdvantageInputs, get_advantage_estimator
from nemo_sspo.algorithms.batch import PolicyBatch, concat_policy_batches, pack_critic_batch
from nemo_sspo.algorithms.losses import make_policy_loss
from nemo_sspo.algorithms.off_policy import effective_sample_size, off_policy_weights
from nemo_sspo.algorithms.segmentation import TABLE_FREE_SEGMENTATIONS, build_segment_tables
from nemo_sspo.data import ShardedSource, build_prompt_source
from nemo_sspo.megatron import (
    build_policy_model,
    export_hf_state_dict,
    iter_hf_weight_buckets,
    ParallelGroups,
    get_parallel_groups,
    initialize_parallel,
    load_hf_into_megatron,
    vocab_shard,
)
from nemo_sspo.megatron.moe import num_experts
from nemo_sspo.megatron.router_replay import (
    check_router_replay,
    engine_routing_sums,
    expert_load_pair,
    stage_moe_layers,
)
from nemo_sspo.megatron.step import LossSpec
from nemo_sspo.megatron.value_model import build_value_model
from nemo_sspo.megatron.training import (
    compute_old_logprobs,
    compute_ref_logprobs,
    train_on_batch,
    build_lr_scheduler,
    wrap_for_training,
)
from nemo_sspo.evaluation import MEAN_KEY
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.models.hf_checkpoint import SOURCES, resolve_model_dir
from nemo_sspo.models.hf_folder import stop_token_ids
from nemo_sspo.metrics import MetricPair, mean_pair, merge_metric_sums
from nemo_sspo.parallel.advantage_scope import data_parallel_advantages
from nemo_sspo.parallel.data_balance import balance_across_data_parallel
from nemo_sspo.parallel.metric_reduce import collective_device, reduce_metric_sums
from nemo_sspo.rewards import Reward, build_reward
from nemo_sspo.rollout import EngineContext, RolloutEngine, build_rollout_engine
from nemo_sspo.rollout.refit_check import VerifiedRefitEngine
from nemo_sspo.trainer.checkpoint import (
    CHECKPOINTS_DIR,
    INTERRUPTED_DIR,
    TrainerState,
    load_checkpoint,
    prepare_output_dir,
    resolve_resume,
    save_checkpoint,
    write_hf_checkpoint,
)
from nemo_sspo.trainer.config import (
    ParallelConfig,
    TrainConfig,
    advantage_estimator_name,
    advantage_normalize_std,
    at_key,
    build_loss_config,
    micro_batch_layout,
)
from nemo_sspo.trainer.critic_training import Critic
from nemo_sspo.trainer.device import check_host, training_device
from nemo_sspo.trainer.interrupt import deferred_signals
from nemo_sspo.trainer.metric_log import MetricsLogger
from nemo_sspo.trainer.periodic_eval import BEST_DIR, BestEval, evaluate_engine
from nemo_sspo.trainer.progress import StepProgress
from nemo_sspo.trainer.rollout_log import RolloutLog, rollout_records
from nemo_sspo.trainer.rollout_metrics import TruncationWatch, rollout_metric_sums
from nemo_sspo.trainer.run_config import composed_config, read_config, resume_changes, write_config
from nemo_sspo.rollouts.records import Rollout
from nemo_sspo.rollouts.sampling import RolloutSampler
from nemo_sspo.trainer.throughput import ModelShape, peak_tflops, step_work_sums, throughput_metrics
from nemo_sspo.rollouts import ColocatedSource, FreeRunningSource, LockStepSource, RolloutSource, StepRollout
from nemo_sspo.rollouts.records import VersionedRollout
from nemo_sspo.trainer.timeline import Timeline
from nemo_sspo.parallel.world_split import WorldSplit
from nemo_sspo.rollouts.slots import rollout_replica
from nemo_sspo.rollouts.worker import RolloutWorker

__all__ = ["GRPOTrainer", "Rollout", "build_rollout", "run_rollout_rank", "start_parallel"]

logger = logging.getLogger(__name__)


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.windows: dict[str, tuple[float, float]] = {}  # unix start / end, for the timeline

    @contextmanager
    def time(self, name: str):
        start, wall = time.perf_counter(), time.time()
        yield
        self.seconds[f"timing/{name}_s"] = time.perf_counter() - start
        self.windows[name] = (wall, time.time())


def start_parallel(parallel_cfg: ParallelConfig, seed: int) -> ParallelGroups:
    """Initialises the process group and Megatron's parallel state for the ``parallel`` section (the
    layout was checked against the world size when the config was loaded); returns this rank's groups.

    Raises:
        ValueError: Megatron's parallel state is already initialised.
    """
    initialize_parallel(tp_size=parallel_cfg.tensor_model_parallel_size,
                        pp_size=parallel_cfg.pipeline_model_parallel_size, seed=seed,
                        ep_size=parallel_cfg.expert_model_parallel_size,
                        cp_size=parallel_cfg.context_parallel_size)
    return get_parallel_groups()


def _model_options(cfg: TrainConfig) -> dict:
    """``build_policy_model`` keyword arguments from the ``model`` and ``parallel`` sections."""
    model_cfg, par = cfg.model, cfg.parallel
    return dict(precision=model_cfg.precision, fp8=model_cfg.fp8, fp8_recipe=model_cfg.fp8_recipe,
                transformer_impl=model_cfg.transformer_impl, recompute=par.recompute,
                recompute_method=par.recompute_method, recompute_num_layers=par.recompute_num_layers,
                sequence_parallel=par.sequence_parallel)


def _wrap(model, optim_cfg, updates: int):
    """Megatron DDP + Adam + learning-rate schedule from an ``OptimConfig`` section.

    Args:
        model: the unwrapped model stage.
        optim_cfg: its ``optim`` section.
        updates: optimizer steps in the whole run (the decay length when ``lr_decay_steps`` is null).

    Returns:
        ``(ddp_model, optimizer, lr_scheduler)``.
    """
    ddp_model, optimizer = wrap_for_training(
        model, lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay, adam_beta1=optim_cfg.adam_beta1,
        adam_beta2=optim_cfg.adam_beta2, adam_eps=optim_cfg.adam_eps, clip_grad=optim_cfg.clip_grad,
        use_distributed_optimizer=optim_cfg.use_distributed_optimizer, cpu_offload=optim_cfg.cpu_offload)
    decay_steps = optim_cfg.lr_decay_steps or max(updates, optim_cfg.lr_warmup_steps + 1)
    scheduler = build_lr_scheduler(optimizer, lr=optim_cfg.lr, min_lr=optim_cfg.min_lr, schedule=optim_cfg.lr_schedule,
                                   warmup_steps=optim_cfg.lr_warmup_steps, decay_steps=decay_steps)
    return ddp_model, optimizer, scheduler


def run_stop_ids(cfg: TrainConfig, tokenizer) -> list[int]:
    """The run's one stop list (``stop_token_ids`` of the tokenizer and ``model.source``'s folder): the
    engines stop at it and every model folder the run writes carries it.
    """
    source = cfg.model.source
    return stop_token_ids(tokenizer, None if source in SOURCES else resolve_model_dir(source))


def build_rollout(cfg: TrainConfig, hf_config, state_dict, tokenizer, prompts, groups, *, stop_ids: list[int],
                  reward: Reward | None = None, engine: RolloutEngine | None = None, shared_stream: bool = True,
                  progress: StepProgress | None = None):
    """Rollout engine, reward and sampler of a generating rank.

    The engine and reward passed in, else ``rollout.backend`` and ``reward.name`` from their
    registries (``nemo_sspo.rollout``, ``nemo_sspo.rewards``). The engine is refitted after every step.

    Args:
        cfg: the run's config.
        hf_config: the policy's HF config.
        state_dict: its HF weights (the initial weights of a built engine).
        tokenizer: its tokenizer.
        prompts: the prompt source.
        groups: the sampler's data-parallel view (``dp_size``, ``dp_rank``, ``dp_group``).
        stop_ids: the run's stop list (:func:`run_stop_ids`).
        reward: a reward to score with, or None to build ``reward.name``.
        engine: an engine holding the initial weights, or None to build ``rollout.backend``.
        shared_stream: as :class:`nemo_sspo.rollouts.sampling.RolloutSampler` (False: a free-running
            rollout rank's own stream and slots).
        progress: the sampler's phase lines (:class:`nemo_sspo.trainer.progress.StepProgress`; None: none).

    Returns:
        ``(engine, reward, sampler)``.
    """
    if engine is None:
        context = EngineContext(hf_config=hf_config, state_dict=state_dict, tokenizer=tokenizer,
                                model_source=cfg.model.source, cache_dir=cfg.model.cache_dir, rollout=cfg.rollout,
                                seed=cfg.trainer.seed, device=training_device(), stop_ids=stop_ids,
                                record_routes=cfg.model.router_replay == "r3",
                                output_precision=cfg.model.output_layer_precision)
        engine = build_rollout_engine(cfg.rollout.backend, context)
    if reward is None:
        reward = build_reward(cfg.reward.name, cfg.reward)
    sampler = RolloutSampler(engine=engine, reward=reward, prompts=prompts, tokenizer=tokenizer, cfg=cfg,
                             groups=groups, shared_stream=shared_stream, progress=progress)
    return engine, reward, sampler


def run_rollout_rank(cfg: TrainConfig, split: WorldSplit, checkpoint=None, *, reward: Reward | None = None) -> None:
    """A rollout rank of ``rollout.placement: separate``: builds the engine (``rollout.backend``), reward
    and prompt stream, runs :class:`nemo_sspo.rollouts.worker.RolloutWorker` until the last step's
    refit (lock-step) or the trainer's stop (``rollout.staleness_schedule: free``), then closes the
    reward and stops the engine (an in-process vLLM ends this process's torch.distributed default
    group: nothing of the rollout side's runs after it).

    Args:
        cfg: the run's validated config.
        split: this rank's place in the split world (a rollout rank).
        checkpoint: as :class:`GRPOTrainer`'s; None loads ``model.source``.
        reward: as :class:`GRPOTrainer`'s; None builds ``reward.name``.

    Raises:
        RuntimeError: a training rank died or hung past the groups' timeout (naming it).
    """
    prompts = at_key("data.options.", lambda: build_prompt_source(cfg.data.source, seed=cfg.trainer.seed,
                                                                  **asdict(cfg.data.options)))
    free = cfg.rollout.staleness_schedule == "free"
    if free:  # each free-running rollout rank draws at its own pace from its own shard of the stream
        prompts = ShardedSource(prompts, index=split.rollout_index(split.rank), count=split.num_rollout_ranks)
    if checkpoint is None:
        checkpoint = load_hf_checkpoint(cfg.model.source, cache_dir=cfg.model.cache_dir)
    hf_config, state_dict, tokenizer = checkpoint
    sampler = None
    try:
        engine, reward, sampler = build_rollout(cfg, hf_config, state_dict, tokenizer, prompts, rollout_replica(split),
                                                stop_ids=run_stop_ids(cfg, tokenizer), reward=reward,
                                                shared_stream=not free)
        if cfg.rollout.partial and not hasattr(engine, "generate_partial"):
            raise ValueError(f"rollout.partial=true: the {cfg.rollout.backend!r} engine ({type(engine).__name__}) has no "
                             "generate_partial to continue responses across refits; use rollout.backend=hf or "
                             "rollout.partial=false")
        # verify_refit: every received refit is checked (the step comes with the stream); sampling uses the
        # same inner engine, which the wrapper only forwards to.
        RolloutWorker(cfg, split, VerifiedRefitEngine(engine) if cfg.rollout.verify_refit else engine, sampler).run()
    finally:
        if sampler is not None:  # the reward (its worker processes) is closed as GRPOTrainer.close does
            try:
                sampler.reward.close()
            finally:
                sampler.engine.shutdown()


class GRPOTrainer:
    """Builds the policy (and, as the loss asks, its frozen reference and the SPPO critic), the
    rollout engine, reward and logger from a validated :class:`TrainConfig`; the reward and the
    engine may be passed in instead (NeMo-RL's ``grpo_train`` takes them the same way).

    Args:
        cfg: the run's config, validated at load time (``nemo_sspo.cli.load_config``).
        groups: this rank's initialised parallel groups (:func:`start_parallel`); the trainer creates
            no global parallel state of its own.
        checkpoint: ``(hf_config, state_dict, tokenizer)`` of ``cfg.model.source`` as returned by
            ``load_hf_checkpoint`` (several trainers in one process can share one load; the state
            dict is copied, never modified); None loads it.
        reward: a :class:`nemo_sspo.rewards.Reward` to score with (closed by :meth:`close`); None
            builds ``reward.name`` from the reward registry. Used on generating ranks only.
        engine: a :class:`nemo_sspo.rollout.RolloutEngine` holding the initial policy weights;
            None builds ``rollout.backend`` from the engine registry. Used on generating ranks only
            (the first model-parallel rank of each data-parallel replica).
        split: with ``rollout.placement: separate``, this training rank's place in the split world
            (:func:`nemo_sspo.parallel.world_split.split_world`): no engine here, rollouts come from the
            rollout ranks and the refit is broadcast to them; None (colocated) otherwise.

    Raises:
        ValueError: a GPU-only setting on a CPU host (:func:`nemo_sspo.trainer.device.check_host`), a parallel
            layout the model's head/layer counts do not allow, a critic checkpoint whose
            tokenizer differs from the policy's, or a ``trainer.resume`` checkpoint that does not fit.
    """

    def __init__(self, cfg: TrainConfig, groups: ParallelGroups, checkpoint=None, *,  # noqa: D107
                 reward: Reward | None = None, engine: RolloutEngine | None = None,
                 split: WorldSplit | None = None) -> None:
        self.cfg, self.split = cfg, split
        check_host(cfg)
        self.peak_tflops = peak_tflops(torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                                       cfg.model.precision, cfg.model.fp8 is not None)
        resume_path = resolve_resume(cfg.trainer.resume, cfg.trainer.output_dir)
        if resume_path is None:
            prepare_output_dir(cfg.trainer, is_writer=dist.get_rank() == 0)
        self.config = composed_config(cfg)  # saved with the run and its checkpoints, compared on resume
        self.groups = groups
        self.loss = make_policy_loss(cfg.loss.name, build_loss_config(cfg.loss))
        needs = self.loss.requirements
        # Data first: a bad source option fails before the model is loaded.
        prompts = at_key("data.options.", lambda: build_prompt_source(cfg.data.source, seed=cfg.trainer.seed,
                                                                      **asdict(cfg.data.options)))
        if checkpoint is None:
            checkpoint = at_key("model.", lambda: load_hf_checkpoint(cfg.model.source, cache_dir=cfg.model.cache_dir))
        hf_config, state_dict, tokenizer = checkpoint
        self.hf_config, self.tokenizer = hf_config, tokenizer
        # The one stop list: the engines and every model folder written (hf_checkpoint, best/, interrupted).
        self.stop_ids = run_stop_ids(cfg, tokenizer)
        self.shape = ModelShape.from_hf_config(hf_config)
        self.model, self.optimizer, self.lr_scheduler = _wrap(
            self._megatron_policy(state_dict), cfg.optim, cfg.trainer.max_steps * cfg.trainer.minibatches_per_step)
        # R3: the engine's routes of this stage's MoE layers become the batch's routes.
        self.route_layers = stage_moe_layers(self.model) if cfg.model.router_replay == "r3" else None
        self.ref_model = self._build_reference(state_dict) if needs.reference_policy else None
        self.estimator = get_advantage_estimator(advantage_estimator_name(cfg))
        self.critic = self._build_critic(state_dict) if self.estimator.needs_critic else None
        self.is_generator = self.groups.mp_rank == 0 and split is None
        self.engine = self.reward = self.sampler = None
        self.progress = StepProgress(enabled=dist.get_rank() == 0, interval_s=cfg.trainer.progress_interval_s,
                                     total_steps=cfg.trainer.max_steps)
        if self.is_generator:
            self._build_rollout(state_dict, prompts, reward, engine)
        self.tables = None
        if needs.segmentation not in TABLE_FREE_SEGMENTATIONS:
            # The model's vocabulary can exceed the tokenizer's (e.g. Qwen2.5: 151,936 rows vs
            # 151,665 ids); ids the tokenizer never decodes close no segment.
            self.tables = build_segment_tables(tokenizer).padded(hf_config.vocab_size)
        vocab_start, vocab_size = vocab_shard(self.model)
        self.spec = LossSpec(loss=self.loss, tp_group=self.groups.tp_group if self.groups.tp_size > 1 else None,
                             cp_group=self.groups.cp_group if self.groups.cp_size > 1 else None,
                             vocab_start=vocab_start, vocab_size=vocab_size,
                             temperature=cfg.rollout.temperature,
                             max_response_length=cfg.rollout.max_new_tokens,
                             output_chunk_size=cfg.parallel.output_chunk_size,
                             router_aux_loss_coef=cfg.model.router_aux_loss_coef,
                             output_precision=cfg.model.output_layer_precision)
        self.layout = micro_batch_layout(cfg.parallel)
        self.completed_steps, self.best = 0, BestEval()
        self.advantage_history: dict[str, PromptRewardStats] = {}
        """Per-prompt reward stats of DCPO's smooth standardisation (the same on every rank)."""
        self.engine_step = 0  # the step whose update the rollout engine holds (saved if a step fails)
        self.interrupted_dir: Path | None = None  # set when fit stops early (hf_checkpoint_interrupted)
        self.source = self._rollout_source()
        self.problems_drawn = 0  # the data position of the trained rollout (later ones may be in flight)
        self.timeline = Timeline()
        self.resume_changes: dict[str, tuple] = {}  # allowed config changes of a resume (run_config.resume_changes)
        if resume_path is not None:
            self._resume(resume_path)
        else:
            self.source.start(0, 0)
        resume_step = self.completed_steps if resume_path is not None else None
        self.logger = MetricsLogger(cfg.trainer.output_dir, cfg.trainer.max_steps, enabled=dist.get_rank() == 0,
                                    resume_step=resume_step, trainer=cfg.trainer, params=asdict(cfg))
        g = self.groups  # the replica's rank that holds the step's advantages writes its responses
        self.rollout_log = (RolloutLog(cfg.trainer.output_dir, g.dp_rank, resume_step=resume_step)
                            if cfg.trainer.rollout_log and g.is_last_stage and g.tp_rank == 0 and g.cp_rank == 0
                            else None)
        if self.logger.enabled:
            write_config(cfg.trainer.output_dir, self.config)
        if self.resume_changes:
            self.logger.log_config_changes(self.completed_steps, self.resume_changes)

    def _megatron_policy(self, state_dict):
        """This rank's Megatron policy stage holding the HF weights (not wrapped)."""
        at_key("model.", lambda: check_router_replay(self.cfg.model.router_replay, self.hf_config))
        model = build_policy_model(self.hf_config, **_model_options(self.cfg))
        load_hf_into_megatron(model, state_dict, self.hf_config)
        return model

    def _build_reference(self, state_dict):
        """Frozen copy of the initial policy (same layout) for the reference-KL term."""
        model = self._megatron_policy(state_dict).eval()
        model.requires_grad_(False)
        return model

    def _build_critic(self, state_dict) -> Critic:
        """The SPPO critic from ``critic.source`` (default: the policy's checkpoint)."""
        cr = self.cfg.critic
        hf_config = self.hf_config
        if cr.source is not None:
            hf_config, state_dict, tokenizer = at_key("critic.", lambda: load_hf_checkpoint(
                cr.source, cache_dir=self.cfg.model.cache_dir))
            if tokenizer.get_vocab() != self.tokenizer.get_vocab():
                raise ValueError(f"critic.source={cr.source!r} has another tokenizer than model.source="
                                 f"{self.cfg.model.source!r}; the critic reads the policy's prompt tokens")
        model = at_key("critic.", lambda: build_value_model(hf_config, state_dict, num_layers=cr.num_layers,
                                                            **_model_options(self.cfg)))
        ddp_model, optimizer, scheduler = _wrap(model, cr.optim, self.cfg.trainer.max_steps)  # one update per step
        return Critic(ddp_model, optimizer, cr.micro_batch_size, lr_scheduler=scheduler)

    def _build_rollout(self, state_dict, prompts, reward: Reward | None, engine: RolloutEngine | None) -> None:
        """Rollout engine, reward and sampler, on generating ranks only (:func:`build_rollout`)."""
        self.engine, self.reward, self.sampler = build_rollout(
            self.cfg, self.hf_config, state_dict, self.tokenizer, prompts, self.groups, stop_ids=self.stop_ids,
            reward=reward, engine=engine, progress=self.progress)

    # ---- phases -------------------------------------------------------------------------------
    def generate_and_score(self, step: int) -> Rollout:
        """This rank's prompt groups, generated and scored (with dynamic sampling if configured);
        shared across the replica's TP/PP ranks.
        """
        rollout = self.sampler.collect(step) if self.is_generator else None
        g = self.groups
        if g.mp_size > 1:
            box = [rollout]
            dist.broadcast_object_list(box, src=g.mp_src_rank, group=g.mp_group)
            rollout = box[0]
        if g.cp_size > 1:  # the CP ranks of a replica split the same rollouts: CP rank 0's
            box = [rollout]
            dist.broadcast_object_list(box, src=g.cp_src_rank, group=g.cp_group)
            rollout = box[0]
        return rollout

    def compute_advantages(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, MetricPair]]:
        """``[B]`` float32 advantages and their metric pairs.

        By the estimator ``advantage.name`` (:mod:`nemo_sspo.algorithms.advantage_estimators`), its scope
        statistics summed over the data-parallel ranks (collective for optimizer-batch and step scopes;
        :func:`nemo_sspo.parallel.advantage_scope.data_parallel_advantages`), before the rows are split
        into mini- and micro-batches. DCPO's smooth standardisation (``DCPO_SMOOTH``, in place of
        ``group`` when the loss asks for it) gathers the step's groups of every data-parallel rank in
        slot order, so each rank's per-prompt history takes the same updates in the same order, whatever
        the data-parallel size. The critic estimator reads V(prompt) from the critic before its update
        (collective over the critic's layout; ranks off the last pipeline stage, which never read
        advantages, get 0).
        """
        group = self.cfg.rollout.samples_per_prompt
        estimator, g = self.estimator, self.groups
        value_logits = None
        if estimator.needs_critic:
            value_logits = self.critic.predict(self._critic_batch(rollout))
            if value_logits is None:
                return torch.zeros_like(rollout.rewards), {}
        # Groups with equal task rewards carry no signal whatever their shaped rewards (the
        # dynamic-sampling filter and its round-limit warning rely on this; config: reward).
        inputs = AdvantageInputs(rollout.rewards, rollout.task_rewards, group,
                                 normalize_std=advantage_normalize_std(self.cfg),
                                 value_logits=value_logits, prompt_keys=rollout.prompt_keys,
                                 history=self.advantage_history)
        advantages, history = data_parallel_advantages(
            estimator, inputs, minibatches=self.cfg.trainer.minibatches_per_step, dp_group=g.dp_group,
            dp_size=g.dp_size)
        if history is not None:
            self.advantage_history = history
        if estimator.needs_critic:
            return advantages, {}
        zero = zero_variance_groups(rollout.task_rewards, group)
        return advantages, {"advantages/zero_variance_group_frac": mean_pair(float(zero.sum()), zero.numel())}

    def _critic_batch(self, rollout: Rollout):
        """The critic's prompts and BCE targets (the 0/1 task rewards)."""
        rb = rollout.batch
        return pack_critic_batch(rb.prompt_ids, rb.prompt_mask, rollout.task_rewards,
                                 self.cfg.rollout.samples_per_prompt, pad_id=self.tokenizer.pad_token_id)

    def prepare_batch(self, rollout: Rollout, advantages: torch.Tensor, sums: dict[str, MetricPair]):
        """From the rollout and its ``[B]`` advantages (:meth:`compute_advantages`, whose metric pairs
        are ``sums``): segment ids and packing; with a token budget
        (``parallel.max_tokens_per_micro_batch``) each mini-batch's rows balanced by tokens across
        data-parallel ranks (:meth:`_balanced`); then pi_old (and pi_ref) log-probs from Megatron,
        and the off-policy correction weights unless ``rollout.correction`` is ``none`` (last pipeline
        stage).

        Returns:
            ``(PolicyBatch, advantage and correction metric pairs)``.
        """
        rb = rollout.batch
        needs = self.loss.requirements
        segments = segment_ids(needs.segmentation, rb.response_ids, rb.response_mask, self.tables,
                               k=needs.segment_k)
        batch = PolicyBatch.from_rollout(rb, segments, advantages, pad_id=self.tokenizer.pad_token_id,
                                         route_layers=self.route_layers)
        if not self.layout.fixed and self.groups.dp_size > 1:
            batch = self._balanced(batch)
        self.progress.phase("old log-probs")
        batch = compute_old_logprobs(self.model, batch, self.spec, self.layout, dp_group=self.groups.dp_group,
                                     record_routes=self.cfg.model.router_replay == "r2")
        if batch.routes is not None:
            sums["moe/expert_load_max_over_mean"] = expert_load_pair(
                batch.routes, batch.row_lengths(), num_experts(self.hf_config), dp_group=self.groups.dp_group)
        if self.ref_model is not None:
            self.progress.phase("reference log-probs")
            batch = compute_ref_logprobs(self.ref_model, batch, self.spec, self.layout, dp_group=self.groups.dp_group,
                                         keep_routes=self.route_layers is not None)
        ro = self.cfg.rollout
        if ro.correction != "none" and self.groups.is_last_stage:
            weights, correction_sums = off_policy_weights(
                ro.correction, batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                segment_ids=batch.segment_ids, cap=ro.correction_cap, low=ro.correction_low, high=ro.correction_high)
            batch = replace(batch, tis_weights=weights)
            sums.update(correction_sums)
        return batch, sums

    def routing_sums(self, batch: PolicyBatch, step: int) -> dict[str, MetricPair]:
        """R3, every ``model.routing_agreement_interval`` steps: one forward-only pass of the policy
        (before its update) with its own routers, compared with the engine's routes and log-probs
        (:func:`~nemo_sspo.megatron.router_replay.engine_routing_sums`); {} otherwise.
        """
        every = self.cfg.model.routing_agreement_interval
        if self.route_layers is None or every == 0 or step % every:
            return {}
        g = self.groups
        own = compute_old_logprobs(self.model, replace(batch, routes=None), self.spec, self.layout,
                                   dp_group=g.dp_group, record_routes=True)
        return engine_routing_sums(batch, own, pp_group=g.pp_group, is_last_stage=g.is_last_stage)

    def _balanced(self, batch):
        """Each mini-batch's rows (the consecutive blocks :meth:`update` steps on) spread over the
        data-parallel ranks by tokens, every rank keeping its row count
        (:func:`nemo_sspo.parallel.data_balance.balance_across_data_parallel`): the forward passes
        and the update then cost every rank about the same.
        """
        size = batch.input_ids.shape[0] // self.cfg.trainer.minibatches_per_step
        return concat_policy_batches([
            balance_across_data_parallel(batch.select(slice(start, start + size)), self.groups.dp_group)
            for start in range(0, batch.input_ids.shape[0], size)])

    def update(self, batch) -> tuple[dict[str, MetricPair], float]:
        """minibatches_per_step optimizer steps over consecutive row blocks of ``batch``.

        Raises:
            FloatingPointError: a mini-batch's gradient norm is NaN or inf. The optimizer step has
                then corrupted the Megatron weights, but the rollout engine still holds the last
                good policy (refit comes after the update), which ``fit`` saves as
                ``hf_checkpoint_interrupted``.
        """
        rows = batch.input_ids.shape[0]
        size = rows // self.cfg.trainer.minibatches_per_step
        sums: dict[str, MetricPair] = {}
        norms = []
        for start in range(0, rows, size):
            self.progress.phase("update", start // size + 1, rows // size, "optimizer steps")
            mb_sums, grad_norm = train_on_batch(self.model, self.optimizer, batch.select(slice(start, start + size)),
                                                self.spec, self.layout, dp_group=self.groups.dp_group,
                                                lr_scheduler=self.lr_scheduler, on_micro_batch=self.progress.micro_batch)
            if not math.isfinite(grad_norm):
                raise FloatingPointError(
                    f"gradient norm {grad_norm} in mini-batch {start // size + 1}: the loss or its gradient "
                    "is not finite (check rewards, optim.lr and the loss.params); the policy of the last "
                    "completed step is kept")
            norms.append(grad_norm)
            sums = merge_metric_sums(sums, mb_sums)
        return sums, sum(norms) / len(norms)

    def _rollout_source(self) -> RolloutSource:
        """This run's rollout source (:mod:`nemo_sspo.rollouts`), from ``rollout.placement`` and
        ``rollout.staleness_schedule``.
        """
        ro, g = self.cfg.rollout, self.groups
        export = lambda: iter_hf_weight_buckets(self.model.module, self.hf_config,  # noqa: E731
                                                ro.refit_bucket_mb << 20, dst_rank=g.mp_src_rank)
        if self.split is None:
            return ColocatedSource(self._versioned_rollout, export, self.engine, max_staleness=ro.max_staleness,
                                   last_step=self.cfg.trainer.max_steps, verify_refit=ro.verify_refit)
        if ro.staleness_schedule == "free":
            return FreeRunningSource(g, self.split, export, max_staleness=ro.max_staleness,
                                     last_step=self.cfg.trainer.max_steps, peer_timeout_s=ro.peer_timeout_s,
                                     pad_id=self.tokenizer.pad_token_id)
        return LockStepSource(g, self.split, export, max_staleness=ro.max_staleness,
                              prompts_per_step=ro.prompts_per_step, pad_id=self.tokenizer.pad_token_id)

    def refit(self) -> float | None:
        """Loads the current Megatron weights into the rollout side now (bucket by bucket,
        ``rollout.refit_bucket_mb``; collective over the training ranks).

        Returns:
            With ``placement: separate``: seconds per GB of the broadcast to the rollout ranks, export
            included (the same on every training rank); None colocated.
        """
        return self.source.push_weights()

    def _versioned_rollout(self, step: int, version: int) -> VersionedRollout:
        """Step ``step``'s rollout from the engine's current weights, ``version`` updates in."""
        start = time.time()
        rollout = self.generate_and_score(step)
        drawn = self.sampler.problems_drawn if self.sampler is not None else 0
        return VersionedRollout(rollout, version=version, problems_drawn=drawn, generated=(start, time.time()))

    def _rollout_side_window(self, versioned: VersionedRollout) -> VersionedRollout:
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

    def train_step(self, step: int) -> dict[str, float]:
        """One step (module docstring); returns its metrics, the same on every rank."""
        timer = _Timer()
        step_start = time.perf_counter()
        self.progress.start_step(step)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        with timer.time("generation"):
            got = self.source.next_rollout(step)
            versioned = self._rollout_side_window(got.versioned)
            rollout, self.problems_drawn = versioned.rollout, versioned.problems_drawn
        with timer.time("train"):
            advantages, batch_sums = self.compute_advantages(rollout)
            if self.rollout_log is not None:
                self.rollout_log.add(rollout_records(step, versioned, advantages, tokenizer=self.tokenizer,
                                                     group_size=self.cfg.rollout.samples_per_prompt,
                                                     replica=self.groups.dp_rank))
            batch, batch_sums = self.prepare_batch(rollout, advantages, batch_sums)
            batch_sums.update(self.routing_sums(batch, step))
            sums, grad_norm = self.update(batch)
        extra = {"optim/grad_norm": grad_norm, "optim/lr": self.optimizer.param_groups[0]["lr"]}  # the last update's
        if self.critic is not None:
            with timer.time("critic"):
                critic_sums, extra["critic/grad_norm"] = self.critic.update(self._critic_batch(rollout))
            sums.update(critic_sums)
        with timer.time("refit"):
            self.progress.phase("refit")
            refit = self.source.after_update(step)
        self.engine_step = step
        if refit.seconds_per_gb is not None:
            extra["timing/refit_s_per_gb"] = refit.seconds_per_gb
        if refit.bytes_to_host is not None:
            extra["refit/bytes_to_host"] = float(refit.bytes_to_host)
        source_sums, source_values = self.source.step_metrics(step, replace(got, versioned=versioned),
                                                              timer.seconds["timing/generation_s"], refit)
        if self.groups.is_last_stage:
            sums.update(batch_sums)
            sums.update(source_sums)
            sums.update(rollout_metric_sums(rollout, batch, samples_per_prompt=self.cfg.rollout.samples_per_prompt,
                                            shaped_rewards=self.cfg.reward.overlong_buffer_len > 0))
            rb = rollout.batch  # old log-probs (1), reference log-probs (1), update forward + backward (3)
            sums.update(step_work_sums(rb.prompt_mask.sum(1), rb.response_mask.sum(1), self.shape,
                                       forward_passes=4 + (self.ref_model is not None)))
        metrics = reduce_metric_sums(sums, dp_group=self.groups.dp_group, pp_group=self.groups.pp_group,
                                     last_stage_rank=self.groups.pp_last_rank, is_last_stage=self.groups.is_last_stage)
        ess = effective_sample_size(metrics)
        if ess is not None:
            metrics["rollout/is_ess"] = ess
        metrics.update(extra)
        metrics.update(timer.seconds)
        metrics["timing/step_s"] = time.perf_counter() - step_start
        metrics["timing/rollout_generation_s"] = versioned.generated[1] - versioned.generated[0]
        metrics.update(throughput_metrics(metrics, dp_size=self.groups.dp_size, training_gpus=dist.get_world_size(),
                                          rollout_gpus=self.source.rollout_gpus, peak=self.peak_tflops))
        if torch.cuda.is_available():
            metrics["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        metrics.update(source_values)
        self._record_timeline(step, timer, got, versioned.generated)
        return metrics

    def _record_timeline(self, step: int, timer: _Timer, got: StepRollout, generated: tuple[float, float]) -> None:
        """This step's phases and its rollout generation (:mod:`nemo_sspo.trainer.timeline`; the source
        gives the generation windows and their lanes, ``generated`` spanning every generating rank).
        """
        for lane, phase, window in self.source.windows(got, generated):
            self.timeline.add(lane, phase, step, *window)
        for phase, window in timer.windows.items():
            if phase == "generation":
                if self.source.wait_phase is None:  # the rollouts' own windows above show this rank generating
                    continue
                phase = self.source.wait_phase  # waiting for the rollout ranks
            self.timeline.add("training ranks", phase, step, *window)

    # ---- evaluation and checkpoints ----------------------------------------------------------------
    def maybe_evaluate(self, step: int) -> dict[str, float]:
        """Every ``eval.every_n_steps`` steps: the benchmarks on the engine's current weights, and a
        new ``best/`` when ``eval/mean`` improves (collective). Returns the eval metrics ({} otherwise).
        """
        every = self.cfg.eval.every_n_steps
        if every == 0 or step % every:
            return {}
        start = time.perf_counter()
        samples = Path(self.cfg.trainer.output_dir) / "eval" / f"step_{step:06d}.jsonl"
        results = evaluate_engine(self.engine, self.tokenizer, self.cfg.eval, self.reward,
                                  template=self.cfg.data.template, samples_path=samples)
        if self.best.improved_by(results[MEAN_KEY]):
            self.best = BestEval(results[MEAN_KEY], step)
            self._save_hf(BEST_DIR, extra={"best": {"step": step, **results}})
        return {**results, "eval/best_mean": self.best.mean, "timing/eval_s": time.perf_counter() - start}

    def _checkpointed_models(self) -> dict:
        """The trained models and their optimizers (the frozen reference is rebuilt from ``model.source``)."""
        models = {"policy": (self.model, self.optimizer, self.lr_scheduler)}
        if self.critic is not None:
            models["critic"] = (self.critic.model, self.critic.optimizer, self.critic.lr_scheduler)
        return models

    def maybe_checkpoint(self, step: int) -> tuple[float, float] | None:
        """Saves a resumable checkpoint every ``trainer.checkpoint_interval`` steps and at the last
        (collective); returns the save's window (unix seconds, start and end), or None without a save.
        """
        tr = self.cfg.trainer
        if tr.checkpoint_interval == 0 or (step % tr.checkpoint_interval and step != tr.max_steps):
            return None
        start = time.time()
        self.progress.phase("checkpoint save")
        # of the step just trained (later steps may be in flight); rank 0 generates or collects
        box = [self.problems_drawn, self.source.rollout_positions()]
        dist.broadcast_object_list(box, src=0)
        history = None
        if self.estimator.next_history is not None:  # DCPO's smooth standardisation, or a plug-in's history
            history = {key: [st.visits, st.mean, st.std] for key, st in self.advantage_history.items()}
        positions = None if box[1] is None else [list(position) for position in box[1]]
        state = TrainerState(step=step, problems_drawn=box[0], seed=tr.seed, world_size=dist.get_world_size(),
                             rollout_positions=positions,
                             best_eval_mean=self.best.mean, best_eval_step=self.best.step,
                             advantage_history=history)
        save_checkpoint(Path(tr.output_dir) / CHECKPOINTS_DIR, state, self._checkpointed_models(),
                        config=self.config, keep=tr.keep_checkpoints)
        return start, time.time()

    def _resume(self, path: Path) -> None:
        """Restores a checkpoint (module docstring of :mod:`nemo_sspo.trainer.checkpoint`) and refits
        the rollout engine with the restored policy.
        """
        state = load_checkpoint(path, self._checkpointed_models(), config=self.config)
        # Settings changed since the checkpoint that a resume allows: one line, and to the trackers.
        saved = read_config(path)  # None: a checkpoint from before configs were saved
        self.resume_changes = resume_changes(saved, self.config) if saved is not None else {}
        if self.resume_changes and dist.get_rank() == 0:
            logger.warning("trainer.resume: settings changed since %s (allowed on resume): %s", path, "; ".join(
                f"{key}: checkpoint {old!r}, now {new!r}" for key, (old, new) in self.resume_changes.items()))
        if self.sampler is not None:
            self.sampler.fast_forward(state.problems_drawn)
        self.completed_steps = state.step
        self.best = BestEval(state.best_eval_mean, state.best_eval_step)
        if self.estimator.next_history is not None:
            if state.advantage_history is None and dist.get_rank() == 0:
                logger.warning("checkpoint %s holds no per-prompt reward history (written without "
                               "loss.params.smooth_advantages or a history-keeping advantage.name): every "
                               "prompt restarts at its first visit", path)
            self.advantage_history = {key: PromptRewardStats(int(visits), float(mean), float(std))
                                      for key, (visits, mean, std) in (state.advantage_history or {}).items()}
        # the rollout side takes the restored weights
        self.source.start(state.step, state.problems_drawn, state.rollout_positions)
        self.engine_step = state.step
        if dist.get_rank() == 0:
            logger.warning("resumed from %s after step %d", path, state.step)
            if self.cfg.rollout.max_staleness > 0:
                logger.warning("rollout.max_staleness=%d: generation restarts from the resumed weights, so steps "
                               "%d.. train on fresher rollouts than an uninterrupted run (lag 0 at step %d)",
                               self.cfg.rollout.max_staleness, state.step + 1, state.step + 1)

    def _save_hf(self, name: str, extra: dict | None = None) -> None:
        """The current policy as a Hugging Face folder ``output_dir/name`` (collective export, rank 0 writes)."""
        state = export_hf_state_dict(self.model.module, self.hf_config, dst_rank=self.groups.mp_src_rank)
        if dist.get_rank() == 0:
            self._write_hf(name, state, extra)

    def _save_interrupted(self) -> Path | None:
        """After a failed or stopped step: rank 0 writes the rollout model (the policy after step
        ``engine_step``: the last completed step, or the abandoned one when it stopped after its
        refit) to ``output_dir/hf_checkpoint_interrupted`` without collectives (other ranks may be
        gone); returns that folder, or None where nothing was written. The vLLM engine's weights
        cannot be read back: resume from the last checkpoint instead.
        """
        if dist.get_rank() != 0 or not self.cfg.trainer.save_hf_checkpoint:
            return None
        state = self.engine.hf_state_dict() if self.engine is not None else None
        if state is None:
            logger.warning("no hf_checkpoint_interrupted: the rollout engine's weights cannot be read back "
                           "(rollout.backend=%s); resume from the last checkpoint (trainer.checkpoint_interval)",
                           self.cfg.rollout.backend)
            return None
        return self._write_hf(INTERRUPTED_DIR, state)

    def _write_hf(self, name: str, state: dict, extra: dict | None = None) -> Path:
        """Writes ``output_dir/name`` with the run's stop list (every model folder of a run goes through here)."""
        return write_hf_checkpoint(Path(self.cfg.trainer.output_dir) / name, self.hf_config, state, self.tokenizer,
                                   extra, stop_ids=self.stop_ids)

    def fit(self) -> list[dict[str, float]]:
        """Runs steps ``completed_steps + 1 .. trainer.max_steps``; returns the per-step metrics (same on
        every rank; with a resumed run, rank 0's list starts with the restored records).

        If a step raises, the policy of the last completed step is saved to
        ``output_dir/hf_checkpoint_interrupted`` before the error propagates (metrics.jsonl already
        holds every completed step). At the end the policy goes to ``output_dir/hf_checkpoint``.
        """
        truncation = TruncationWatch(self.cfg.rollout.max_new_tokens)
        saved_s = None  # the last step's checkpoint save, reported with the next step (its record was written)
        try:
            for step in range(self.completed_steps + 1, self.cfg.trainer.max_steps + 1):
                metrics = self.train_step(step)
                warning = truncation.check(step, metrics)
                if warning and self.logger.enabled:
                    logger.warning(warning)
                metrics.update(self.maybe_evaluate(step))
                if saved_s is not None:
                    metrics["timing/checkpoint_s"] = saved_s
                with deferred_signals():  # a stop signal waits: the step's record, checkpoint and count agree
                    self.logger.log(step, metrics)
                    if self.rollout_log is not None:
                        self.rollout_log.flush()
                    saved = self.maybe_checkpoint(step)
                    self.completed_steps = step
                saved_s = None if saved is None else saved[1] - saved[0]
                if saved is not None:
                    self.timeline.add("training ranks", "checkpoint", step, *saved)
        except BaseException:
            if self.logger.history:
                self.interrupted_dir = self._save_interrupted()
            raise
        finally:
            self.close()
        if self.cfg.trainer.save_hf_checkpoint:
            self._save_hf("hf_checkpoint")
        if dist.get_rank() == 0:  # the run finished: an earlier stop's export is stale
            shutil.rmtree(Path(self.cfg.trainer.output_dir) / INTERRUPTED_DIR, ignore_errors=True)
        return self.logger.history

    def close(self) -> None:
        """Closes the logger (writing its plots), draws ``timeline.png`` on rank 0, stops the reward pool."""
        self.logger.close()
        if self.rollout_log is not None:
            self.rollout_log.close()
        if dist.get_rank() == 0:
            self.timeline.write(Path(self.cfg.trainer.output_dir))
        if self.reward is not None:
            self.reward.close()

    def shutdown_engine(self) -> None:
        """Stops the rollout engine (``RolloutEngine.shutdown``: vLLM's ends torch.distributed, so only
        once this process runs no more collectives); the CLI calls it before ``destroy_parallel``. Ranks
        without an engine (other model-parallel ranks, training ranks of a separate placement) do nothing.
        """
        if self.engine is not None:
            self.engine.shutdown()

