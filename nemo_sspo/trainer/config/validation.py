"""Checking a loaded config: :func:`validate` (every section's ``problems`` and every rule of
:data:`~nemo_sspo.trainer.config.rules.RULES`, all reported in one error) and
:func:`check_model_layout` (the layout against the model's config.json).
"""

from __future__ import annotations

from typing import Any

from nemo_sspo.algorithms.advantage_estimators import AdvantageEstimator, get_advantage_estimator
from nemo_sspo.algorithms.losses import LossRequirements, get_policy_loss
from nemo_sspo.megatron.model import check_architecture
from nemo_sspo.megatron.moe import is_moe
from nemo_sspo.rollout.vllm_engine import serves_adapters
from nemo_sspo.trainer.config.advantage_section import advantage_estimator_name
from nemo_sspo.trainer.config.keyed import failed, problems_at_key
from nemo_sspo.trainer.config.loss_section import build_loss_config
from nemo_sspo.trainer.config.rules import RULES, Facts
from nemo_sspo.trainer.config.train_config import SECTIONS, TrainConfig

__all__ = ["check_model_layout", "config_error", "facts_of", "problems_of", "validate"]


def facts_of(cfg: TrainConfig, world_size: int | None) -> Facts:
    """What the sections imply, each fact None where a broken section leaves it unknown.

    Args:
        cfg: the composed config.
        world_size: as :func:`validate`.

    Returns:
        The facts the rules read.
    """
    par = cfg.parallel
    sizes = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size)
    model_parallel = (sizes[0] * sizes[1] * sizes[2]
                      if all(isinstance(size, int) and size >= 1 for size in sizes) else None)
    if world_size is None:  # one data-parallel replica, no Megatron model
        training_ranks = model_parallel
    else:
        training_ranks = world_size - cfg.rollout.schedule.num_ranks
        training_ranks = training_ranks if training_ranks > 0 else None
    dp = (training_ranks // model_parallel
          if training_ranks is not None and model_parallel is not None and training_ranks % model_parallel == 0
          else None)
    loss = _loss_requirements(cfg)
    return Facts(launched=world_size, training_ranks=training_ranks, model_parallel=model_parallel, dp=dp,
                 loss=loss, estimator=_estimator(cfg) if loss is not None else None)


def _loss_requirements(cfg: TrainConfig) -> LossRequirements | None:
    try:
        return get_policy_loss(cfg.loss.name).requirements(build_loss_config(cfg.loss))
    except ValueError:
        return None


def _estimator(cfg: TrainConfig) -> AdvantageEstimator | None:
    try:
        return get_advantage_estimator(advantage_estimator_name(cfg))
    except ValueError:
        return None


def problems_of(cfg: TrainConfig, world_size: int | None = 1) -> list[str]:
    """Every problem of a loaded config: each section's own (in :data:`SECTIONS` order), then each
    rule's that fails (in :data:`RULES` order; a rule whose facts are unknown is skipped).

    Args:
        cfg: the composed config.
        world_size: as :func:`validate`.

    Returns:
        The messages, each naming the full key path and the fix; empty for a valid config.
    """
    found = [problem for name in SECTIONS for problem in getattr(cfg, name).problems(name)]
    facts = facts_of(cfg, world_size)
    for rule in RULES:
        if any(getattr(facts, name) is None for name in rule.facts) or not rule.when(cfg, facts):
            continue
        if not rule.holds(cfg, facts):
            found.append(rule.message(cfg, facts))
    return found


def config_error(problems: list[str]) -> ValueError:
    """One error for every problem: the message itself for one, a numbered list for several.

    Args:
        problems: at least one message.

    Returns:
        The error to raise.
    """
    if len(problems) == 1:
        return ValueError(problems[0])
    listed = "\n".join(f"  {i}. {problem}" for i, problem in enumerate(problems, 1))
    return ValueError(f"{len(problems)} config problems:\n{listed}")


def validate(cfg: TrainConfig, world_size: int | None = 1) -> None:
    """Every check of a loaded config (the one copy: lower layers check only their own arguments),
    every failure reported at once.

    Args:
        cfg: the composed config.
        world_size: processes launched; the training ranks among them (all but ``rollout.schedule.num_ranks``)
            must be divisible by the parallel layout. None for a run that builds no Megatron model
            (``nemo-sspo eval``): one data-parallel replica.

    Raises:
        ValueError: listing every problem (:func:`problems_of`), each naming the key path and the fix.
    """
    problems = problems_of(cfg, world_size)
    if problems:
        raise config_error(problems)


def check_model_layout(cfg: TrainConfig, hf_config: Any, world_size: int | None = 1) -> None:
    """The layout facts of ``model.source``'s config.json against the config (heads and key/value
    heads by the trainer's and vLLM's tensor parallelism, layers by pipeline stages and the critic's
    layers, the engine's context length), so a layout the model cannot take fails before any weight
    is read.

    Args:
        cfg: the composed, validated config.
        hf_config: the model's config (``nemo_sspo.models.load_hf_config``: no weights read).
        world_size: as :func:`validate`; None (``nemo-sspo eval``: no Megatron model) skips the
            trainer's layout.

    Raises:
        ValueError: listing every problem, each naming the config key, the model's field and the sizes
            that would work.
    """
    model = f"model.source={cfg.model.source!r}"
    par, ro = cfg.parallel, cfg.rollout
    problems: list[str] = []
    if world_size is not None:
        problems += problems_at_key(f"{model}: ", lambda: check_architecture(
            hf_config, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
            ep_size=par.expert_model_parallel_size, tp_name="parallel.tensor_model_parallel_size",
            pp_name="parallel.pipeline_model_parallel_size", ep_name="parallel.expert_model_parallel_size"))
        problems += par.recompute_problems("parallel", hf_config.num_hidden_layers // par.pipeline_model_parallel_size)
        tp, layers = par.tensor_model_parallel_size, cfg.critic.num_layers
        problems += failed(
            (tp == 1 or par.sequence_parallel or not is_moe(hf_config),
             f"parallel.tensor_model_parallel_size={tp} with the mixture-of-experts {model} needs "
             "parallel.sequence_parallel=true (megatron-core 0.16.1 trains MoE layers under TP only with "
             "sequence parallelism); set it, or set parallel.tensor_model_parallel_size=1 and split the "
             "experts with parallel.expert_model_parallel_size"),
            (cfg.model.router_aux_loss_coef == 0 or is_moe(hf_config),
             f"model.router_aux_loss_coef={cfg.model.router_aux_loss_coef} needs a mixture-of-experts "
             f"model; {model} has no router: set it to 0"),
            (layers is None or layers <= hf_config.num_hidden_layers,
             f"critic.num_layers={layers} exceeds the {hf_config.num_hidden_layers} layers of "
             f"{model}; use at most that, or null for all"),
        )
    if ro.engine.backend == "vllm":
        vllm = ro.engine.options
        heads, kv_heads, vtp = hf_config.num_attention_heads, hf_config.num_key_value_heads, vllm.tensor_parallel_size
        context = hf_config.max_position_embeddings
        limit = vllm.max_model_len or context
        problems += failed(
            # vLLM shards query heads and either shards or replicates key/value heads.
            (heads % vtp == 0 and (kv_heads % vtp == 0 or vtp % kv_heads == 0),
             f"rollout.engine.options.tensor_parallel_size={vtp} does not split the {heads} heads / {kv_heads} "
             f"key/value heads of {model}: use a size dividing {heads} that divides or is a multiple of {kv_heads}"),
            (vllm.max_model_len is None or vllm.max_model_len <= context,
             f"rollout.engine.options.max_model_len={vllm.max_model_len} exceeds max_position_embeddings={context} "
             f"of {model}; use at most {context}, or null"),
            (ro.sampling.max_new_tokens < limit,
             f"rollout.sampling.max_new_tokens={ro.sampling.max_new_tokens} leaves no room for a prompt in vLLM's "
             f"context of {limit} tokens ({model}); lower it or raise rollout.engine.options.max_model_len"),
            (cfg.model.lora.refit != "adapters" or serves_adapters(hf_config),
             f"model.lora.refit='adapters' with the mixture-of-experts {model}: vLLM's CPU build cannot serve "
             "LoRA adapters on it (with LoRA enabled it runs the experts through Triton GPU kernels); set "
             "model.lora.refit=merged on this host"),
        )
    if problems:
        raise config_error(problems)
