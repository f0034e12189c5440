"""The memory plan of a run, before launch: bytes per GPU and pipeline stage, and the load-time check.

``nemo-sspo plan <overrides>`` prints it (exit 0: fits, 2: does not), ``--print-config`` ends with
it, and ``nemo-sspo train`` refuses a config whose peak exceeds the GPU's memory
(``trainer.gpu_memory_gib``, else the visible device's; no check on a host without a GPU) unless
``trainer.skip_memory_check`` is set. Pure arithmetic over the model's config.json (or its published
architecture, :mod:`nemo_sspo.models.published`) and the typed config: no GPU, no model build.

Terms per rank of a pipeline stage (the per-tensor sources are in :mod:`nemo_sspo.megatron.memory`):

* ``policy weights``, ``policy gradients``, ``policy optimizer``: :func:`~nemo_sspo.megatron.memory.model_state_bytes`
  (exact: equal to the built objects' bytes); under LoRA (``model.lora``) the frozen base counts its
  weights only and the gradients and optimizer states are the adapters';
* ``reference weights`` (a loss with ``kl_coef > 0`` keeps a frozen copy; none under LoRA, whose
  reference is the base model under the adapters), ``critic state`` and
  ``critic activations`` (``advantage.name=critic``, e.g. ``loss=sppo``: the critic's weights,
  gradients and Adam states, and one critic micro-batch of prompts);
* ``activations``: one micro-batch's saved activations times the micro-batches in flight under
  1F1B pipelining (``PP - stage``: stage 0 holds PP of them), plus, with ``parallel.recompute=full``,
  one recomputed chunk rebuilt during the backward;
* ``output layer``: the last stage's loss side. Fused (``parallel.output_chunk_size``): the gathered
  hidden states of the response tokens (at most the micro-batch's tokens, ``T h e``) and the chunk's
  fp32 logits, probabilities and logit gradient ``3 x chunk x V_local x 4`` (ours, an upper estimate);
  Megatron's output layer: the fp32 logits and their gradient, ``2 x T x V_local x 4``;
* ``rollout engine`` (colocated): vLLM takes ``gpu_memory_utilization`` of the GPU's total memory
  for its weights (bf16 model / ``rollout.engine.options.tensor_parallel_size``) and KV cache (the rest of that
  share; a share that does not exceed the weights is refused, naming the smallest
  ``gpu_memory_utilization`` that holds them); the transformers engine a copy of the weights in
  ``model.precision``.

Peak: the resident state (weights, gradients, optimizer, reference, critic) plus the larger of the
training phase (activations, output layer) and the generation phase (the engine) with
``rollout.engine.options.enable_sleep_mode`` (the engine's weights go to host memory and its KV cache is freed
while training), or plus both without it. ``rollout.schedule.placement=separate``: the training GPUs hold no
engine (the rollout ranks' GPUs hold it alone).

Micro-batch tokens ``T``: ``parallel.max_tokens_per_micro_batch`` (a packed row, or the worst case of
one row that long), else ``parallel.micro_batch_size`` rows of the longest sequence
(``rollout.engine.options.max_model_len``, else ``rollout.sampling.max_new_tokens`` + 1,024 prompt tokens, at most
``max_position_embeddings``); divided by ``parallel.context_parallel_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from nemo_sspo.algorithms.advantage_estimators import get_advantage_estimator
from nemo_sspo.megatron.memory import activation_bytes, model_state_bytes, rank_parameters
from nemo_sspo.trainer.config import advantage_estimator_name

__all__ = ["GIB", "PROMPT_ALLOWANCE", "MemoryPlan", "StagePlan", "check_memory_plan", "format_memory_plan",
           "gpu_memory_gib", "hf_architecture", "memory_plan", "plan_for_config"]

GIB = 2**30
PROMPT_ALLOWANCE = 1024
"""Prompt tokens assumed for fixed-row micro-batches when no engine context length bounds them."""

_SHRINK = {
    "policy weights": ["a larger parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size"],
    "policy gradients": ["a larger parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size"],
    "policy optimizer": ["optim.use_distributed_optimizer=true (states sharded over data parallelism)",
                         "optim.cpu_offload=true (with the distributed optimizer)",
                         "a larger parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size"],
    "reference weights": ["a larger parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size",
                          "loss.params.kl_coef=0 (no reference policy)"],
    "critic state": ["critic.num_layers (a smaller critic)", "a larger parallel.tensor_model_parallel_size"],
    "critic activations": ["a smaller critic.micro_batch_size"],
    "activations": ["parallel.recompute=full (or selective)",
                    "parallel.sequence_parallel=true (with TP > 1)",
                    "a smaller parallel.max_tokens_per_micro_batch (or parallel.micro_batch_size)",
                    "a larger parallel.tensor_model_parallel_size or parallel.context_parallel_size"],
    "output layer": ["a smaller parallel.output_chunk_size (the fused output layer; null computes all logits)",
                     "a smaller parallel.max_tokens_per_micro_batch"],
    "rollout engine": ["a smaller rollout.engine.options.gpu_memory_utilization",
                       "rollout.engine.options.enable_sleep_mode=true (engine memory released while training)",
                       "rollout.schedule.placement=separate (the engine on rollout ranks' own GPUs)"],
}
"""Settings that shrink each term (the refusal names those of the largest one)."""


@dataclass
class StagePlan:
    """One pipeline stage's rank: ``terms`` in bytes (name -> bytes, in table order), the phases and peak."""

    stage: int
    terms: dict[str, float]
    resident: float
    training: float
    generation: float
    peak: float

    def largest_term(self) -> str:
        """The name of the largest term."""
        return max(self.terms, key=self.terms.get)


@dataclass
class MemoryPlan:
    """The plan of every pipeline stage; ``gpu_bytes`` the GPU memory checked against (None: unknown)."""

    stages: list[StagePlan]
    gpu_bytes: float | None
    layout: str
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        """The largest stage peak, bytes."""
        return max(stage.peak for stage in self.stages)

    @property
    def fits(self) -> bool | None:
        """Peak <= GPU memory; None when the GPU memory is unknown."""
        return None if self.gpu_bytes is None else self.peak <= self.gpu_bytes


def gpu_memory_gib(cfg: Any) -> float | None:
    """``trainer.gpu_memory_gib``, else the visible CUDA device's total memory in GiB, else None."""
    if cfg.trainer.gpu_memory_gib is not None:
        return float(cfg.trainer.gpu_memory_gib)
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
    return None


def _sequence_shape(cfg: Any, hf: Any) -> tuple[int, int, int]:
    """``(tokens T, rows b, width s)`` of the largest micro-batch on one rank (module docstring)."""
    par, ro = cfg.parallel, cfg.rollout
    vllm_len = ro.engine.options.max_model_len if ro.engine.backend == "vllm" else None
    longest = vllm_len or ro.sampling.max_new_tokens + PROMPT_ALLOWANCE
    longest = min(longest, hf.max_position_embeddings)
    cp = par.context_parallel_size
    if par.max_tokens_per_micro_batch is not None:
        tokens = par.max_tokens_per_micro_batch
        width = tokens if par.pack_sequences else min(tokens, longest)
        rows = max(1, tokens // width)
        return tokens // cp, rows, width // cp
    return par.micro_batch_size * longest // cp, par.micro_batch_size, longest // cp


def _impl(cfg: Any, gpu_known: bool) -> str:
    impl = cfg.model.transformer_impl
    if impl == "auto":
        return "transformer_engine" if gpu_known else "local"
    return impl


def _critic_config(cfg: Any, hf: Any, critic_hf: Any | None) -> Any:
    import copy

    critic = copy.deepcopy(critic_hf if critic_hf is not None else hf)
    if cfg.critic.num_layers is not None:
        critic.num_hidden_layers = cfg.critic.num_layers
    return critic


def memory_plan(cfg: Any, hf_config: Any, *, world_size: int, gpu_gib: float | None,
                critic_hf_config: Any | None = None) -> MemoryPlan:
    """Bytes per rank of every pipeline stage for ``cfg`` on ``hf_config``'s model (module docstring).

    Args:
        cfg: a loaded, validated :class:`~nemo_sspo.trainer.config.TrainConfig`.
        hf_config: ``model.source``'s HF config (or its published architecture).
        world_size: processes launched (the rollout ranks of ``placement=separate`` included).
        gpu_gib: GPU memory in GiB (sizes the vLLM share and the check), or None if unknown.
        critic_hf_config: ``critic.source``'s config when it differs from ``model.source``.

    Returns:
        :class:`MemoryPlan` (its notes say when the activations are the TransformerEngine layers'
        formula, not yet measured on a GPU).

    Raises:
        ValueError: a colocated vLLM engine's share of the GPU cannot hold the model's weights
            (names ``rollout.engine.options.gpu_memory_utilization`` and the minimum it needs).
    """
    par, ro, op = cfg.parallel, cfg.rollout, cfg.optim
    tp, pp, ep, cp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                      par.expert_model_parallel_size, par.context_parallel_size)
    dp = max(1, (world_size - ro.schedule.num_ranks) // (tp * pp * cp))
    param_bytes = 2 if cfg.model.precision == "bf16" else 4
    gpu_bytes = None if gpu_gib is None else gpu_gib * GIB
    impl = _impl(cfg, gpu_bytes is not None)
    tokens, rows, width = _sequence_shape(cfg, hf_config)
    kl = getattr(cfg.loss.params, "kl_coef", 0.0) or 0.0
    critic = get_advantage_estimator(advantage_estimator_name(cfg)).needs_critic  # the SPPO critic's own model
    vocab_local = math.ceil(hf_config.vocab_size / (128 * tp)) * 128
    total_params = sum(p.numel for p in rank_parameters(hf_config, tp=1, pp=1, ep=1))
    vllm = ro.engine.backend == "vllm"  # only the vllm engine's options hold its sizes
    vllm_weights = 2 * total_params / ro.engine.options.tensor_parallel_size if vllm else 0.0  # bf16, per vLLM TP rank
    if ro.schedule.placement == "colocated" and ro.engine.backend == "vllm" and gpu_bytes is not None:
        _check_engine_share(ro.engine.options, gpu_bytes, vllm_weights)
    lora = dict(lora_rank=cfg.model.lora.rank, lora_targets=tuple(str(t) for t in cfg.model.lora.target)
                if cfg.model.lora.rank else ())
    stages = []
    for stage in range(pp):
        params = rank_parameters(hf_config, tp=tp, pp=pp, ep=ep, stage=stage, **lora)
        state = model_state_bytes(params, param_bytes=param_bytes, dp=dp * cp, ep=ep,
                                  distributed_optimizer=op.use_distributed_optimizer, cpu_offload=op.cpu_offload)
        terms: dict[str, float] = {"policy weights": state.weights, "policy gradients": state.gradients,
                                   "policy optimizer": state.optimizer}
        if kl > 0 and not cfg.model.lora.rank:  # LoRA: the reference is the base model under the adapters
            terms["reference weights"] = param_bytes * state.numel
        if critic:
            chf = _critic_config(cfg, hf_config, critic_hf_config)
            cparams = [p for p in rank_parameters(chf, tp=tp, pp=pp, ep=ep, stage=stage)
                       if p.name != "output_layer.weight"]
            cstate = model_state_bytes(cparams, param_bytes=param_bytes, dp=dp * cp, ep=ep,
                                       distributed_optimizer=cfg.critic.optim.use_distributed_optimizer,
                                       cpu_offload=cfg.critic.optim.cpu_offload)
            terms["critic state"] = cstate.weights + cstate.gradients + cstate.optimizer
            prompt = max(1, width - ro.sampling.max_new_tokens)
            cact = activation_bytes(chf, tokens=cfg.critic.micro_batch_size * prompt, rows=cfg.critic.micro_batch_size,
                                    seq=prompt, tp=tp, pp=pp, stage=stage, act_bytes=param_bytes, impl=impl)
            terms["critic activations"] = cact.saved
        act = activation_bytes(hf_config, tokens=tokens, rows=rows, seq=width, tp=tp, pp=pp, stage=stage,
                               act_bytes=param_bytes, impl=impl, recompute=par.recompute,
                               recompute_method=par.recompute_method, recompute_num_layers=par.recompute_num_layers,
                               sequence_parallel=par.sequence_parallel, lora_dropout=cfg.model.lora.dropout, **lora)
        terms["activations"] = act.saved * (pp - stage) + act.recompute_working
        if stage == pp - 1:
            if par.output_chunk_size is not None:
                terms["output layer"] = tokens * hf_config.hidden_size * param_bytes + 3 * min(
                    par.output_chunk_size, tokens) * vocab_local * 4
            else:
                terms["output layer"] = 2 * tokens * vocab_local * 4
        engine = 0.0
        if ro.schedule.placement == "colocated":
            if ro.engine.backend == "vllm" and gpu_bytes is not None:
                engine = ro.engine.options.gpu_memory_utilization * gpu_bytes
            elif ro.engine.backend != "vllm":
                engine = param_bytes * total_params
        terms["rollout engine"] = engine
        resident = sum(v for k, v in terms.items() if k in (
            "policy weights", "policy gradients", "policy optimizer", "reference weights", "critic state"))
        training = resident + terms["activations"] + terms.get("output layer", 0.0) + terms.get("critic activations", 0.0)
        generation = resident + engine
        sleeps = ro.engine.backend == "vllm" and ro.engine.options.enable_sleep_mode
        peak = max(training, generation) if sleeps else training + engine
        stages.append(StagePlan(stage, terms, resident, training, generation, peak))
    notes = [f"layout TP={tp} x PP={pp} x CP={cp} x DP={dp} (EP={ep}); {cfg.model.precision} weights; "
             f"{impl} layers; micro-batch {tokens:,} tokens per rank ({rows} row(s) of {width:,}); "
             f"recompute={par.recompute}; sequence_parallel={par.sequence_parallel}; "
             f"distributed optimizer={op.use_distributed_optimizer}, cpu_offload={op.cpu_offload}"]
    if cfg.model.lora.rank:
        trained = sum(p.numel for p in rank_parameters(hf_config, tp=1, pp=1, ep=1, **lora) if not p.frozen)
        notes.append(f"LoRA rank {cfg.model.lora.rank} on {', '.join(lora['lora_targets'])}: {trained:,} trained "
                     f"parameters ({trained / total_params:.2%} of {total_params:,}); base weights frozen"
                     + ("; the KL reference is the base model (no copy)" if kl > 0 else ""))
    if cfg.model.transformer_impl == "auto":  # the one rule of plan and --print-config, said where it applies
        notes.append(f"layers: {impl}, as model.transformer_impl=auto builds them " + (
            "on a GPU (a GPU is visible or trainer.gpu_memory_gib is set)" if impl == "transformer_engine" else
            "on a host without a GPU (set trainer.gpu_memory_gib, or model.transformer_impl=transformer_engine, to "
            "plan the GPU run's TransformerEngine layers)"))
    if impl == "transformer_engine":
        notes.append("activations: the TransformerEngine layers' formula (nemo_sspo.megatron.memory) is our "
                     "reading of their modules, not yet measured on a GPU; the local layers' is measured")
    if ro.schedule.placement == "colocated" and ro.engine.backend == "vllm":
        if gpu_bytes is None:
            notes.append("rollout engine: vLLM takes rollout.engine.options.gpu_memory_utilization of the GPU's memory, "
                         "unknown here: set trainer.gpu_memory_gib")
        else:
            kv = ro.engine.options.gpu_memory_utilization * gpu_bytes - vllm_weights
            notes.append(f"rollout engine: vLLM {ro.engine.options.gpu_memory_utilization:g} x {gpu_gib:.2f} GiB = "
                         f"{vllm_weights / GIB:.2f} GiB bf16 weights + {kv / GIB:.2f} GiB KV cache and activations; "
                         + ("released while training (sleep mode): peak = resident + max(training, generation)"
                            if ro.engine.options.enable_sleep_mode else "held while training: peak = training + engine"))
    return MemoryPlan(stages=stages, gpu_bytes=gpu_bytes, layout=f"TP={tp} x PP={pp} x CP={cp} x DP={dp}",
                      notes=notes)


def _check_engine_share(vllm: Any, gpu_bytes: float, weights: float) -> None:
    """Refuses a colocated vLLM share of the GPU (``gpu_memory_utilization x gpu_bytes``) that does not
    exceed the engine's bf16 ``weights`` (bytes per vLLM TP rank): no room would be left for a KV cache.

    Raises:
        ValueError: naming ``rollout.engine.options.gpu_memory_utilization``, the share against the weights, and the
            smallest value (2 decimals, rounded up) whose share holds the weights, or, when even the whole
            GPU cannot, ``rollout.engine.options.tensor_parallel_size``.
    """
    share = vllm.gpu_memory_utilization * gpu_bytes
    if share > weights:
        return
    minimum = math.floor(100 * weights / gpu_bytes + 1) / 100  # the smallest 2-decimal value above
    fix = (f"set rollout.engine.options.gpu_memory_utilization to at least {minimum:.2f} (the weights alone; the KV "
           f"cache needs more)" if minimum < 1 else
           f"even the whole GPU cannot hold them: raise rollout.engine.options.tensor_parallel_size "
           f"(now {vllm.tensor_parallel_size})")
    raise ValueError(
        f"memory plan: rollout.engine.options.gpu_memory_utilization={vllm.gpu_memory_utilization:g} gives the colocated "
        f"vLLM engine {share / GIB:.2f} GiB of the GPU's {gpu_bytes / GIB:.2f} GiB, not more than the model's "
        f"{weights / GIB:.2f} GiB of bf16 weights per engine GPU (rollout.engine.options.tensor_parallel_size="
        f"{vllm.tensor_parallel_size}), so nothing is left for its KV cache: {fix}")


def format_memory_plan(plan: MemoryPlan, prefix: str = "") -> str:
    """The plan as a table: one row per term, one column per pipeline stage, GiB with 2 decimals."""
    names = list(dict.fromkeys(name for stage in plan.stages for name in stage.terms))
    header = ["term (GiB per GPU)"] + [f"stage {s.stage}" for s in plan.stages]
    rows = [[name] + [f"{s.terms.get(name, 0.0) / GIB:.2f}" for s in plan.stages] for name in names]
    rows += [["training phase"] + [f"{s.training / GIB:.2f}" for s in plan.stages],
             ["generation phase"] + [f"{s.generation / GIB:.2f}" for s in plan.stages],
             ["peak"] + [f"{s.peak / GIB:.2f}" for s in plan.stages]]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"{prefix}memory plan ({plan.layout}):"]
    lines += [prefix + "  " + "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                                        enumerate(zip(r, widths, strict=True))) for r in [header, *rows]]
    if plan.gpu_bytes is None:
        lines.append(f"{prefix}GPU memory unknown (no GPU visible): set trainer.gpu_memory_gib to check the plan")
    else:
        gpu = plan.gpu_bytes / GIB
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(f"{prefix}peak {plan.peak / GIB:.2f} GiB of {gpu:.2f} GiB: {verdict} "
                     f"(headroom {100 * (1 - plan.peak / plan.gpu_bytes):.1f}%)")
        if not plan.fits:
            lines.append(f"{prefix}{_largest_term_advice(plan)}")
    lines += [prefix + note for note in plan.notes]
    return "\n".join(lines)


def check_memory_plan(plan: MemoryPlan) -> None:
    """Refuses a plan whose peak exceeds the GPU memory (no-op when it is unknown).

    Raises:
        ValueError: naming the stage, its peak against the GPU memory, the largest term and the
            settings that shrink it, and ``trainer.skip_memory_check=true``.
    """
    if plan.fits is not False:
        return
    stage = max(plan.stages, key=lambda s: s.peak)
    raise ValueError(
        f"memory plan: the peak of pipeline stage {stage.stage} is {stage.peak / GIB:.2f} GiB per GPU, more than "
        f"the GPU's {plan.gpu_bytes / GIB:.2f} GiB (trainer.gpu_memory_gib, or the visible device's); "
        f"{_largest_term_advice(plan)}. See the whole plan with `nemo-sspo plan` (same overrides); set "
        f"trainer.skip_memory_check=true to start anyway")


def _largest_term_advice(plan: MemoryPlan) -> str:
    """The largest term of the stage with the highest peak, and the settings that shrink it."""
    stage = max(plan.stages, key=lambda s: s.peak)
    largest = stage.largest_term()
    return (f"the largest term is {largest} ({stage.terms[largest] / GIB:.2f} GiB). Settings that shrink it: "
            f"{'; '.join(_SHRINK.get(largest, []))}")


def hf_architecture(source: str, cache_dir: str | None) -> tuple[Any, str]:
    """``(hf_config, origin)`` of a model source: its local config.json, else its published
    architecture (:mod:`nemo_sspo.models.published`); ``origin`` says which, for messages.

    Raises:
        FileNotFoundError: neither is available (names ``source``).
    """
    from nemo_sspo.models import load_hf_config
    from nemo_sspo.models.published import published_config

    try:
        return load_hf_config(source, cache_dir=cache_dir), "its config.json"
    except (ValueError, FileNotFoundError) as err:
        hf_config = published_config(source)
        if hf_config is None:
            raise FileNotFoundError(f"no config for {source!r} here and no published architecture ({err})") from None
        return hf_config, "its published architecture (not in the local cache)"


def plan_for_config(cfg: Any, world_size: int, hf_config: Any | None = None) -> MemoryPlan:
    """:func:`memory_plan` of a loaded config: the model's (and critic's) architecture read as
    ``--print-config`` reads it, the GPU memory from :func:`gpu_memory_gib`.

    Raises:
        FileNotFoundError: ``model.source`` (or ``critic.source``) has no config here and is not a
            published architecture.
        ValueError: as :func:`memory_plan`.
    """
    origin = "the given config"
    if hf_config is None:
        hf_config, origin = hf_architecture(cfg.model.source, cfg.model.cache_dir)
    critic_hf = None
    if cfg.critic.source is not None and cfg.critic.source != cfg.model.source:
        critic_hf = hf_architecture(cfg.critic.source, cfg.model.cache_dir)[0]
    plan = memory_plan(cfg, hf_config, world_size=world_size, gpu_gib=gpu_memory_gib(cfg), critic_hf_config=critic_hf)
    plan.notes.insert(0, f"model.source={cfg.model.source} ({origin}); world size {world_size}")
    return plan
