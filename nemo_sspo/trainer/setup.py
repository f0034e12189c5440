"""Set-up of a run's parts, one function per part, in the order the recipe calls them.

A training rank (:class:`nemo_sspo.trainer.loop.GRPOTrainer`):

1. :func:`start_parallel`: the process group and Megatron's parallel state (the CLI, before the trainer);
2. the prompt source (``data``), so a bad source option fails before the model is loaded;
3. the Hugging Face checkpoint of ``model.source`` and the run's stop list (:func:`run_stop_ids`);
4. :func:`build_policy`: the Megatron policy with its optimizer and schedule, then the frozen
   reference where the loss has a KL term (:func:`build_reference`) and the SPPO critic where the
   estimator reads one (:func:`build_critic`);
5. :func:`build_rollout` on the replica's generating rank: engine, reward and sampler;
6. what the loss reads of a batch (:func:`loss_spec`, :func:`segment_tables`), for the policy's step;
7. :func:`build_rollout_source`: where rollouts come from and where weights go (with the weight exporter);
8. only then the output folder (checkpoint resume or a fresh folder) and the loggers: nothing is
   written before the config and the model are known to be valid.

A rollout rank (``rollout.schedule.placement: separate``) runs :func:`run_rollout_rank` instead.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch.distributed as dist

from nemo_sspo.algorithms.segmentation import TABLE_FREE_SEGMENTATIONS, build_segment_tables
from nemo_sspo.data import ShardedSource, build_prompt_source
from nemo_sspo.megatron import (
    AdapterExporter,
    ParallelGroups,
    WeightExporter,
    build_policy_model,
    get_parallel_groups,
    initialize_parallel,
    load_hf_into_megatron,
    vocab_shard,
)
from nemo_sspo.megatron.lora import LoraSettings
from nemo_sspo.megatron.router_replay import check_router_replay
from nemo_sspo.megatron.step import LossSpec
from nemo_sspo.megatron.training import build_lr_scheduler, wrap_for_training
from nemo_sspo.megatron.value_model import build_value_model
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.models.hf_checkpoint import SOURCES, resolve_model_dir
from nemo_sspo.models.hf_folder import stop_token_ids
from nemo_sspo.parallel.world_split import WorldSplit
from nemo_sspo.rewards import Reward, build_reward
from nemo_sspo.rollout import EngineContext, RolloutEngine, build_rollout_engine
from nemo_sspo.rollout.refit_check import VerifiedRefitEngine
from nemo_sspo.rollouts import ColocatedSource, FreeRunningSource, LockStepSource, RolloutSource
from nemo_sspo.rollouts.producer import FanOut, RolloutProducer
from nemo_sspo.rollouts.sampling import RolloutSampler
from nemo_sspo.rollouts.slots import rollout_replica
from nemo_sspo.rollouts.worker import RolloutWorker
from nemo_sspo.trainer.checkpoint import base_checksum
from nemo_sspo.trainer.config import ParallelConfig, TrainConfig, at_key
from nemo_sspo.trainer.critic_training import Critic
from nemo_sspo.trainer.device import training_device

__all__ = ["adapters_base_checksum", "build_critic", "build_policy", "build_prompts", "build_reference", "build_rollout", "build_rollout_source",
           "fan_out", "load_checkpoint_of", "lora_settings", "loss_spec", "model_options", "run_rollout_rank", "run_stop_ids",
           "segment_tables", "start_parallel", "wrap_for_updates"]


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


def build_prompts(cfg: TrainConfig):
    """The prompt source of ``data`` (seeded with ``trainer.seed``).

    Raises:
        ValueError: a bad ``data.options`` field, named with its key.
    """
    return at_key("data.options.", lambda: build_prompt_source(cfg.data.source, seed=cfg.trainer.seed,
                                                               **asdict(cfg.data.options)))


def model_options(cfg: TrainConfig) -> dict:
    """``build_policy_model`` keyword arguments from the ``model`` and ``parallel`` sections."""
    model_cfg, par = cfg.model, cfg.parallel
    return dict(precision=model_cfg.precision, fp8=model_cfg.fp8, fp8_recipe=model_cfg.fp8_recipe,
                transformer_impl=model_cfg.transformer_impl, recompute=par.recompute,
                recompute_method=par.recompute_method, recompute_num_layers=par.recompute_num_layers,
                sequence_parallel=par.sequence_parallel)


def wrap_for_updates(model, optim_cfg, updates: int):
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


def lora_settings(cfg: TrainConfig) -> LoraSettings | None:
    """The policy's adapters (``model.lora`` with ``trainer.seed``), or None at ``model.lora.rank: 0``."""
    lora = cfg.model.lora
    if lora.rank == 0:
        return None
    return LoraSettings(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                        targets=tuple(str(target) for target in lora.target), seed=cfg.trainer.seed)


def _megatron_stage(cfg: TrainConfig, hf_config, state_dict, lora: LoraSettings | None = None):
    """This rank's Megatron policy stage holding the HF weights (not wrapped), with ``lora``'s adapters."""
    at_key("model.", lambda: check_router_replay(cfg.model.router_replay, hf_config))
    model = at_key("model.", lambda: build_policy_model(hf_config, **model_options(cfg), lora=lora))
    load_hf_into_megatron(model, state_dict, hf_config)
    return model


def build_policy(cfg: TrainConfig, hf_config, state_dict):
    """The trained policy stage: ``(ddp_model, optimizer, lr_scheduler)`` (``optim``; one optimizer step
    per mini-batch over ``trainer.max_steps`` steps). With ``model.lora.rank >= 1`` only its adapters
    train (:func:`lora_settings`).

    Raises:
        ValueError: a router-replay mode the model cannot replay (``model.router_replay``); adapters
            on a model or layer spec that cannot take them (``model.lora``).
    """
    updates = cfg.trainer.max_steps * cfg.trainer.minibatches_per_step
    return wrap_for_updates(_megatron_stage(cfg, hf_config, state_dict, lora_settings(cfg)), cfg.optim, updates)


def adapters_base_checksum(cfg: TrainConfig, state_dict) -> list[int] | None:
    """LoRA: :func:`~nemo_sspo.trainer.checkpoint.base_checksum` of the base weights ``state_dict`` (the
    checkpoints hold the adapters only, so they record which weights they sit on), computed once on
    rank 0 (a pass over every weight) and broadcast; None without adapters. Collective.
    """
    if lora_settings(cfg) is None:
        return None
    box = [base_checksum(state_dict) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def build_reference(cfg: TrainConfig, hf_config, state_dict, policy):
    """The reference policy of a KL term: under LoRA the policy stage ``policy`` itself, read with its
    adapters off (:func:`~nemo_sspo.megatron.lora.adapters_disabled`, no second model); otherwise a
    frozen copy of the initial policy (same layout).
    """
    if lora_settings(cfg) is not None:
        return policy
    model = _megatron_stage(cfg, hf_config, state_dict).eval()
    model.requires_grad_(False)
    return model


def loss_spec(cfg: TrainConfig, loss, groups: ParallelGroups, model) -> LossSpec:
    """What the loss reads on this rank: the loss, its TP/CP groups (None at size 1), the stage's
    vocabulary shard, the sampling temperature, the response cap, the output chunking and precision.
    """
    vocab_start, vocab_size = vocab_shard(model)
    return LossSpec(loss=loss, tp_group=groups.tp_group if groups.tp_size > 1 else None,
                    cp_group=groups.cp_group if groups.cp_size > 1 else None, vocab_start=vocab_start,
                    vocab_size=vocab_size, temperature=cfg.rollout.sampling.temperature,
                    max_response_length=cfg.rollout.sampling.max_new_tokens,
                    output_chunk_size=cfg.parallel.output_chunk_size,
                    router_aux_loss_coef=cfg.model.router_aux_loss_coef,
                    output_layer_precision=cfg.model.output_layer_precision)


def segment_tables(segmentation: str, tokenizer, hf_config):
    """The segment tables of ``segmentation`` padded to the model's vocabulary, or None for a
    segmentation that needs none. The model's vocabulary can exceed the tokenizer's (Qwen2.5: 151,936
    rows vs 151,665 ids); ids the tokenizer never decodes close no segment.
    """
    if segmentation in TABLE_FREE_SEGMENTATIONS:
        return None
    return build_segment_tables(tokenizer).padded(hf_config.vocab_size)


def build_critic(cfg: TrainConfig, hf_config, state_dict, tokenizer) -> Critic:
    """The SPPO critic from ``critic.source`` (default: the policy's checkpoint, ``hf_config`` and
    ``state_dict``), one update per step.

    Raises:
        ValueError: ``critic.source`` has another tokenizer than the policy's.
    """
    cr = cfg.critic
    if cr.source is not None:
        hf_config, state_dict, critic_tokenizer = at_key("critic.", lambda: load_hf_checkpoint(
            cr.source, cache_dir=cfg.model.cache_dir))
        if critic_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"critic.source={cr.source!r} has another tokenizer than model.source="
                             f"{cfg.model.source!r}; the critic reads the policy's prompt tokens")
    model = at_key("critic.", lambda: build_value_model(hf_config, state_dict, num_layers=cr.num_layers,
                                                        **model_options(cfg)))
    ddp_model, optimizer, scheduler = wrap_for_updates(model, cr.optim, cfg.trainer.max_steps)
    return Critic(ddp_model, optimizer, cr.micro_batch_size, lr_scheduler=scheduler)


def build_rollout(cfg: TrainConfig, hf_config, state_dict, tokenizer, prompts, groups, *, stop_ids: list[int],
                  reward: Reward | None = None, engine: RolloutEngine | None = None, shared_stream: bool = True,
                  progress=None) -> tuple[RolloutEngine, Reward, RolloutSampler]:
    """Rollout engine, reward and sampler of a generating rank.

    The engine and reward passed in, else ``rollout.engine.backend`` and ``reward.name`` from their
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
        engine: an engine holding the initial weights, or None to build ``rollout.engine.backend``.
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
                                output_layer_precision=cfg.model.output_layer_precision,
                                adapter_rank=cfg.model.lora.rank if cfg.model.lora.refit == "adapters" else 0)
        engine = build_rollout_engine(cfg.rollout.engine.backend, context)
    if reward is None:
        reward = build_reward(cfg.reward.name, cfg.reward)
    sampler = RolloutSampler(engine=engine, reward=reward, prompts=prompts, tokenizer=tokenizer, cfg=cfg,
                             groups=groups, shared_stream=shared_stream, progress=progress)
    return engine, reward, sampler


def fan_out(groups: ParallelGroups) -> list[FanOut]:
    """The in-replica fan-out of a colocated replica's rollout: from its generating rank to its other
    model-parallel ranks, then (context parallelism) from CP rank 0 to the CP ranks, which split the
    same rollouts.
    """
    hops = []
    if groups.mp_size > 1:
        hops.append(FanOut(groups.mp_src_rank, groups.mp_group))
    if groups.cp_size > 1:
        hops.append(FanOut(groups.cp_src_rank, groups.cp_group))
    return hops


def build_rollout_source(cfg: TrainConfig, groups: ParallelGroups, split: WorldSplit | None, model, hf_config, *,
                         sampler: RolloutSampler | None, engine: RolloutEngine | None, pad_id: int) -> RolloutSource:
    """This run's rollout source (:mod:`nemo_sspo.rollouts`), from ``rollout.schedule.placement`` and
    ``rollout.schedule.mode``, with the weight exporter of ``model`` (gathered on the replica's
    first model-parallel rank; the adapters alone with ``model.lora.refit=adapters``).

    Args:
        cfg: the run's config.
        groups: this training rank's parallel groups.
        split: its place in a split world (``placement: separate``), or None (colocated).
        model: the policy stage (its weights are exported after every update).
        hf_config: the policy's HF config.
        sampler: colocated, the generating rank's sampler (None on the replica's other ranks).
        engine: colocated, the generating rank's engine (None elsewhere).
        pad_id: the tokenizer's pad id.
    """
    ro, lora = cfg.rollout, lora_settings(cfg)
    if lora is not None and cfg.model.lora.refit == "adapters":
        exporter = AdapterExporter(model, hf_config, scaling=lora.scaling, dst_rank=groups.mp_src_rank)
    else:
        exporter = WeightExporter(model, hf_config, bucket_bytes=ro.refit.bucket_mb << 20, dst_rank=groups.mp_src_rank)
    if split is None:
        return ColocatedSource(RolloutProducer(sampler, fan_out(groups)), exporter, engine,
                               max_staleness=ro.schedule.max_staleness, last_step=cfg.trainer.max_steps,
                               verify_refit=ro.refit.verify)
    if ro.schedule.mode == "free":
        return FreeRunningSource(groups, split, exporter, max_staleness=ro.schedule.max_staleness,
                                 last_step=cfg.trainer.max_steps, peer_timeout_s=ro.schedule.peer_timeout_s,
                                 pad_id=pad_id)
    return LockStepSource(groups, split, exporter, max_staleness=ro.schedule.max_staleness,
                          prompts_per_step=ro.prompts_per_step, pad_id=pad_id)


def run_rollout_rank(cfg: TrainConfig, split: WorldSplit, checkpoint=None, *, reward: Reward | None = None) -> None:
    """A rollout rank of ``rollout.schedule.placement: separate``: builds the engine
    (``rollout.engine.backend``), reward and prompt stream, runs
    :class:`nemo_sspo.rollouts.worker.RolloutWorker` until the last step's refit (lock-step) or the
    trainer's stop (``rollout.schedule.mode: free``), then closes the reward and stops the engine (an in-process vLLM ends this process's torch.distributed default
    group: nothing of the rollout side's runs after it).

    Args:
        cfg: the run's validated config.
        split: this rank's place in the split world (a rollout rank).
        checkpoint: ``(hf_config, state_dict, tokenizer)`` as ``load_hf_checkpoint`` returns it; None
            loads ``model.source``.
        reward: a reward to score with; None builds ``reward.name``.

    Raises:
        ValueError: ``rollout.schedule.partial`` with an engine that cannot continue responses across refits.
        RuntimeError: a training rank died or hung past the groups' timeout (naming it).
    """
    prompts = build_prompts(cfg)
    free = cfg.rollout.schedule.mode == "free"
    if free:  # each free-running rollout rank draws at its own pace from its own shard of the stream
        prompts = ShardedSource(prompts, index=split.rollout_index(split.rank), count=split.num_rollout_ranks)
    hf_config, state_dict, tokenizer = load_checkpoint_of(cfg, checkpoint)
    sampler = None
    try:
        engine, reward, sampler = build_rollout(cfg, hf_config, state_dict, tokenizer, prompts, rollout_replica(split),
                                                stop_ids=run_stop_ids(cfg, tokenizer), reward=reward,
                                                shared_stream=not free)
        if cfg.rollout.schedule.partial and not hasattr(engine, "generate_partial"):
            raise ValueError(f"rollout.schedule.partial=true: the {cfg.rollout.engine.backend!r} engine "
                             f"({type(engine).__name__}) has no generate_partial to continue responses across refits; "
                             "use rollout.engine.backend=hf or rollout.schedule.partial=false")
        # rollout.refit.verify: every received refit is checked (the step comes with the stream); sampling uses the
        # same inner engine, which the wrapper only forwards to.
        RolloutWorker(cfg, split, VerifiedRefitEngine(engine) if cfg.rollout.refit.verify else engine,
                      RolloutProducer(sampler, [])).run()
    finally:
        if sampler is not None:  # the reward (its worker processes) is closed as GRPOTrainer.close does
            try:
                sampler.reward.close()
            finally:
                sampler.engine.shutdown()


def load_checkpoint_of(cfg: TrainConfig, checkpoint: Any):
    """``checkpoint`` if given, else ``model.source`` loaded (errors named with ``model.``)."""
    if checkpoint is not None:
        return checkpoint
    return at_key("model.", lambda: load_hf_checkpoint(cfg.model.source, cache_dir=cfg.model.cache_dir))
