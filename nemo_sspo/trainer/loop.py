"""The GRPO-family recipe: one training step read top to bottom, and the run around it.

A training rank's step (:meth:`GRPOTrainer.train_step`) is seven calls::

    next rollout (the rollout source: generated here, received from rollout ranks, or k steps old)
    -> advantages (the estimator ``advantage.name``) -> batch, with old (and reference) log-probs
    -> update (``trainer.minibatches_per_step`` optimizer steps) [-> critic update]
    -> publish weights (the source's refit) -> finish metrics

Each call goes to a part built once by :mod:`nemo_sspo.trainer.setup` (in the order documented there):
the rollout source (:mod:`nemo_sspo.rollouts`: colocated, lock-step or free-running separate, each
with a :class:`~nemo_sspo.rollouts.producer.RolloutProducer` or rollout ranks, and a
:class:`~nemo_sspo.megatron.WeightExporter`), the advantages
(:class:`~nemo_sspo.trainer.advantage_step.AdvantageStep`), the policy
(:class:`~nemo_sspo.trainer.policy.Policy`) and the step's figures
(:class:`~nemo_sspo.trainer.step_metrics.StepMetrics`, whose observers see each phase's output).
No part holds the trainer or a closure of it.

Rollouts are generated one prompt group per ``generate`` call, seeded by (seed, step, sampling
round, global prompt index) (:mod:`nemo_sspo.rollouts.sampling`), so the samples do not depend on
how prompts are split over data-parallel ranks: the same seed and config give the same first step
for any TP x PP x DP layout. What the loss asks of the step is in its requirements
(:class:`nemo_sspo.algorithms.losses.PolicyLossConfig`): the segmentation, the default of
``advantage.normalize_std``, a frozen reference for ``kl_coef > 0``. Around the steps:
evaluation every ``eval.every_n_steps`` (:mod:`nemo_sspo.trainer.periodic_eval`), resumable
checkpoints (:mod:`nemo_sspo.trainer.checkpoint`) and the final Hugging Face export.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_sspo.algorithms.advantage_estimators import get_advantage_estimator
from nemo_sspo.algorithms.losses import make_policy_loss
from nemo_sspo.evaluation import MEAN_KEY
from nemo_sspo.megatron import ParallelGroups
from nemo_sspo.megatron.router_replay import stage_moe_layers
from nemo_sspo.parallel.world_split import WorldSplit
from nemo_sspo.rewards import Reward
from nemo_sspo.rollout import RolloutEngine
from nemo_sspo.trainer import setup
from nemo_sspo.trainer.advantage_step import AdvantageStep
from nemo_sspo.trainer.checkpoint import (
    CHECKPOINTS_DIR,
    INTERRUPTED_DIR,
    TrainerState,
    load_checkpoint,
    prepare_output_dir,
    resolve_resume,
    save_checkpoint,
)
from nemo_sspo.trainer.config import (
    TrainConfig,
    advantage_estimator_name,
    advantage_normalize_std,
    build_loss_config,
    micro_batch_layout,
)
from nemo_sspo.trainer.device import check_host
from nemo_sspo.trainer.interrupt import deferred_signals
from nemo_sspo.trainer.metric_log import MetricsLogger
from nemo_sspo.trainer.model_folders import ModelFolders
from nemo_sspo.trainer.periodic_eval import BEST_DIR, BestEval, evaluate_engine
from nemo_sspo.trainer.policy import Policy
from nemo_sspo.trainer.progress import StepProgress
from nemo_sspo.trainer.rollout_log import RolloutLog
from nemo_sspo.trainer.rollout_metrics import TruncationWatch
from nemo_sspo.trainer.run_config import composed_config, read_config, resume_changes, write_config
from nemo_sspo.trainer.step_metrics import StepMetrics
from nemo_sspo.trainer.throughput import ModelShape, peak_tflops

__all__ = ["GRPOTrainer"]

logger = logging.getLogger(__name__)


class GRPOTrainer:
    """A training rank's run: builds its parts from a validated :class:`TrainConfig` (the reward and
    the engine may be passed in instead, as NeMo-RL's ``grpo_train`` takes them) and runs the steps.

    Args:
        cfg: the run's config, validated at load time (``nemo_sspo.cli.load_config``).
        groups: this rank's initialised parallel groups (:func:`nemo_sspo.trainer.setup.start_parallel`).
        checkpoint: ``(hf_config, state_dict, tokenizer)`` of ``cfg.model.source`` as returned by
            ``load_hf_checkpoint`` (several trainers in one process can share one load; the state
            dict is copied, never modified); None loads it.
        reward: a :class:`nemo_sspo.rewards.Reward` to score with (closed by :meth:`close`); None
            builds ``reward.name``. Used on generating ranks only.
        engine: a :class:`nemo_sspo.rollout.RolloutEngine` holding the initial policy weights; None
            builds ``rollout.engine.backend``. Used on generating ranks only (each replica's first
            model-parallel rank).
        split: with ``rollout.schedule.placement: separate``, this training rank's place in the split world
            (:func:`nemo_sspo.parallel.world_split.split_world`); None (colocated) otherwise.

    Raises:
        ValueError: a GPU-only setting on a CPU host, a parallel layout the model's head/layer counts
            do not allow, a critic checkpoint whose tokenizer differs from the policy's, or a
            ``trainer.resume`` checkpoint that does not fit.
    """

    def __init__(self, cfg: TrainConfig, groups: ParallelGroups, checkpoint=None, *,  # noqa: D107
                 reward: Reward | None = None, engine: RolloutEngine | None = None,
                 split: WorldSplit | None = None) -> None:
        self.cfg, self.groups, tr = cfg, groups, cfg.trainer
        check_host(cfg)
        self.config = composed_config(cfg)  # saved with the run and its checkpoints, compared on resume
        loss = make_policy_loss(cfg.loss.name, build_loss_config(cfg.loss))
        needs = loss.requirements
        prompts = setup.build_prompts(cfg)
        self.hf_config, state_dict, self.tokenizer = setup.load_checkpoint_of(cfg, checkpoint)
        self.stop_ids = setup.run_stop_ids(cfg, self.tokenizer)
        self.folders = ModelFolders(tr.output_dir, self.hf_config, self.tokenizer, self.stop_ids,
                                    lora=setup.lora_settings(cfg), base_model=cfg.model.source)
        model, optimizer, scheduler = setup.build_policy(cfg, self.hf_config, state_dict)
        self.base_checksum = setup.adapters_base_checksum(cfg, state_dict)
        self.model, self.optimizer = model, optimizer
        self.ref_model = setup.build_reference(cfg, self.hf_config, state_dict, model) if needs.reference_policy else None
        estimator = get_advantage_estimator(advantage_estimator_name(cfg))
        self.critic = (setup.build_critic(cfg, self.hf_config, state_dict, self.tokenizer)
                       if estimator.needs_critic else None)
        pad_id = self.tokenizer.pad_token_id
        self.advantages = AdvantageStep(estimator, groups, samples_per_prompt=cfg.rollout.samples_per_prompt,
                                        minibatches=tr.minibatches_per_step, normalize_std=advantage_normalize_std(cfg),
                                        critic=self.critic, pad_id=pad_id)
        self.progress = StepProgress(enabled=dist.get_rank() == 0, interval_s=tr.progress_interval_s,
                                     total_steps=tr.max_steps)
        self.engine = self.reward = self.sampler = None
        if groups.mp_rank == 0 and split is None:  # the replica's generating rank
            self.engine, self.reward, self.sampler = setup.build_rollout(
                cfg, self.hf_config, state_dict, self.tokenizer, prompts, groups, stop_ids=self.stop_ids,
                reward=reward, engine=engine, progress=self.progress)
        self.policy = Policy(model, optimizer, scheduler, self.ref_model, setup.loss_spec(cfg, loss, groups, model),
                             micro_batch_layout(cfg.parallel), groups, self.hf_config, cfg,
                             setup.segment_tables(needs.segmentation, self.tokenizer, self.hf_config), pad_id,
                             stage_moe_layers(model) if cfg.model.router_replay == "r3" else None, self.progress)
        self.source = setup.build_rollout_source(cfg, groups, split, model.module, self.hf_config,
                                                 sampler=self.sampler, engine=self.engine, pad_id=pad_id)
        peak = peak_tflops(torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                           cfg.model.precision, cfg.model.fp8 is not None)
        self.metrics = StepMetrics(groups, samples_per_prompt=cfg.rollout.samples_per_prompt,
                                   shaped_rewards=cfg.reward.overlong_buffer_len > 0,
                                   shape=ModelShape.from_hf_config(self.hf_config),
                                   forward_passes=4 + (self.ref_model is not None), peak=peak)
        self.completed_steps, self.best, self.engine_step, self.problems_drawn = 0, BestEval(), 0, 0
        self.interrupted_dir: Path | None = None  # set when fit stops early (hf_checkpoint_interrupted)
        self.resume_changes: dict[str, tuple] = {}  # allowed config changes of a resume (run_config.resume_changes)
        # The parts are valid: only now does the run touch its output folder.
        resume_path = resolve_resume(tr.resume, tr.output_dir)
        if resume_path is None:
            prepare_output_dir(tr, is_writer=dist.get_rank() == 0)
            self.source.start(0, 0)
        else:
            self._resume(resume_path)
        resume_step = self.completed_steps if resume_path is not None else None
        self.logger = MetricsLogger(tr.output_dir, tr.max_steps, enabled=dist.get_rank() == 0,
                                    resume_step=resume_step, trainer=tr, params=asdict(cfg))
        self.rollout_log = None  # the replica's rank that holds the step's advantages writes its responses
        if tr.rollout_log and groups.is_last_stage and groups.tp_rank == 0 and groups.cp_rank == 0:
            self.rollout_log = RolloutLog(tr.output_dir, groups.dp_rank, resume_step=resume_step,
                                          tokenizer=self.tokenizer, samples_per_prompt=cfg.rollout.samples_per_prompt)
            self.metrics.observers.append(self.rollout_log.observe)
        if self.logger.enabled:
            write_config(tr.output_dir, self.config)
        if self.resume_changes:
            self.logger.log_config_changes(self.completed_steps, self.resume_changes)

    # ---- the step ----------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        """One step (module docstring); returns its metrics, the same on every rank."""
        m = self.metrics
        m.begin(step)
        self.progress.start_step(step)
        with m.phase("generation"):
            got = m.observe("rollout", self.source.next_rollout(step))
        rollout, self.problems_drawn = got.versioned.rollout, got.versioned.problems_drawn
        with m.phase("train"):
            advantages, batch_pairs = self.advantages.compute(rollout)
            m.observe("advantages", (got.versioned, advantages))
            batch, batch_pairs = self.policy.prepare_batch(rollout, advantages, batch_pairs)
            m.observe("batch", batch)
            batch_pairs.update(self.policy.routing_sums(batch, step))
            update_pairs, grad_norm = m.observe("update", self.policy.update(batch))
        m.add(update_pairs, {"optim/grad_norm": grad_norm, "optim/lr": self.optimizer.param_groups[0]["lr"]},
              last_stage_pairs=batch_pairs)
        if self.critic is not None:
            with m.phase("critic"):
                critic_pairs, critic_norm = self.critic.update(self.advantages.critic_batch(rollout))
            m.add(critic_pairs, {"critic/grad_norm": critic_norm})
        with m.phase("refit"):
            self.progress.phase("refit")
            refit = m.observe("refit", self.source.after_update(step))
        self.engine_step = step
        return m.finish(got, self.source, refit, batch)

    def compute_advantages(self, rollout):
        """The step's advantages of ``rollout`` (:meth:`AdvantageStep.compute`)."""
        return self.advantages.compute(rollout)

    def prepare_batch(self, rollout, advantages, sums):
        """The policy batch of ``rollout`` (:meth:`Policy.prepare_batch`)."""
        return self.policy.prepare_batch(rollout, advantages, sums)

    # ---- the run ----------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Runs steps ``completed_steps + 1 .. trainer.max_steps``; returns the per-step metrics (same on
        every rank; with a resumed run, rank 0's list starts with the restored records).

        If a step raises, the policy of the last completed step is saved to
        ``output_dir/hf_checkpoint_interrupted`` before the error propagates (metrics.jsonl already
        holds every completed step). At the end the policy goes to ``output_dir/hf_checkpoint``.
        """
        truncation = TruncationWatch(self.cfg.rollout.sampling.max_new_tokens)
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
                    self.metrics.checkpoint_window(step, saved)
        except BaseException:
            if self.logger.history and self.cfg.trainer.save_hf_checkpoint:
                self.interrupted_dir = self.folders.save_interrupted(self.engine, self.cfg.rollout.engine.backend)
            raise
        finally:
            self.close()
        if self.cfg.trainer.save_hf_checkpoint:
            self.folders.save("hf_checkpoint", self.model.module, self.groups.mp_src_rank)
        if dist.get_rank() == 0:  # the run finished: an earlier stop's export is stale
            shutil.rmtree(Path(self.cfg.trainer.output_dir) / INTERRUPTED_DIR, ignore_errors=True)
        return self.logger.history

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
            self.folders.save(BEST_DIR, self.model.module, self.groups.mp_src_rank, extra={"best": {"step": step, **results}})
        return {**results, "eval/best_mean": self.best.mean, "timing/eval_s": time.perf_counter() - start}

    def _checkpointed_models(self) -> dict:
        """The trained models and their optimizers (the frozen reference is rebuilt from ``model.source``)."""
        p = self.policy
        models = {"policy": (p.model, p.optimizer, p.lr_scheduler)}
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
        positions = None if box[1] is None else [list(position) for position in box[1]]
        state = TrainerState(step=step, problems_drawn=box[0], seed=tr.seed, world_size=dist.get_world_size(),
                             rollout_positions=positions, best_eval_mean=self.best.mean,
                             best_eval_step=self.best.step, advantage_history=self.advantages.history_state(),
                             base_checksum=self.base_checksum)
        save_checkpoint(Path(tr.output_dir) / CHECKPOINTS_DIR, state, self._checkpointed_models(),
                        config=self.config, keep=tr.keep_checkpoints)
        return start, time.time()

    def _resume(self, path: Path) -> None:
        """Restores a checkpoint (module docstring of :mod:`nemo_sspo.trainer.checkpoint`) and refits
        the rollout side with the restored policy.
        """
        state = load_checkpoint(path, self._checkpointed_models(), config=self.config, base=self.base_checksum)
        # Settings changed since the checkpoint that a resume allows: one line, and to the trackers.
        saved = read_config(path)  # None: a checkpoint from before configs were saved
        self.resume_changes = resume_changes(saved, self.config) if saved is not None else {}
        if self.resume_changes and dist.get_rank() == 0:
            logger.warning("trainer.resume: settings changed since %s (allowed on resume): %s", path, "; ".join(
                f"{key}: checkpoint {old!r}, now {new!r}" for key, (old, new) in self.resume_changes.items()))
        if self.sampler is not None:
            self.sampler.fast_forward(state.problems_drawn)
        self.completed_steps = self.engine_step = state.step
        self.best = BestEval(state.best_eval_mean, state.best_eval_step)
        if not self.advantages.restore_history(state.advantage_history) and dist.get_rank() == 0:
            logger.warning("checkpoint %s holds no per-prompt reward history (written without a "
                           "history-keeping advantage.name such as dcpo_smooth): every prompt restarts at its "
                           "first visit", path)
        self.source.start(state.step, state.problems_drawn, state.rollout_positions)  # the restored weights
        if dist.get_rank() == 0:
            logger.warning("resumed from %s after step %d", path, state.step)
            if self.cfg.rollout.schedule.max_staleness > 0:
                logger.warning("rollout.schedule.max_staleness=%d: generation restarts from the resumed weights, so "
                               "steps %d.. train on fresher rollouts than an uninterrupted run (lag 0 at step %d)",
                               self.cfg.rollout.schedule.max_staleness, state.step + 1, state.step + 1)

    def close(self) -> None:
        """Closes the logger (writing its plots), draws ``timeline.png`` on rank 0, stops the reward pool."""
        self.logger.close()
        if self.rollout_log is not None:
            self.rollout_log.close()
        if dist.get_rank() == 0:
            self.metrics.timeline.write(Path(self.cfg.trainer.output_dir))
        if self.reward is not None:
            self.reward.close()

    def shutdown_engine(self) -> None:
        """Stops the rollout engine (``RolloutEngine.shutdown``: vLLM's ends torch.distributed, so only
        once this process runs no more collectives); the CLI calls it before ``destroy_parallel``. Ranks
        without an engine (other model-parallel ranks, training ranks of a separate placement) do nothing.
        """
        if self.engine is not None:
            self.engine.shutdown()
