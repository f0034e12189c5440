"""Typed configuration of a GRPO-family training run.

Each section is a dataclass registered in Hydra's ConfigStore; the YAML files under ``conf/`` are
merged onto ``OmegaConf.structured(TrainConfig)``, so a misspelt key or a wrong type fails when the
config is loaded. Every default lives here, on its field. Checks that involve more than one field are
in :func:`validate`, which raises ``ValueError`` naming the full key path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from nemo_sspo.algorithms.losses import get_policy_loss
from nemo_sspo.data import PROMPT_SOURCES, TEMPLATES

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "DataConfig",
    "RolloutConfig",
    "RewardConfig",
    "OptimConfig",
    "LossSection",
    "TrainerConfig",
    "TrainConfig",
    "validate",
    "build_loss_config",
]


@dataclass
class ModelConfig:
    source: str = "smollm2-135m-instruct"
    """Checkpoint to start from: see ``nemo_sspo.models.load_hf_checkpoint`` for the names."""
    cache_dir: str | None = None
    """Where dequantised weights are cached; None = ``$NEMO_SSPO_CACHE`` or ``~/.cache/nemo_sspo``."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP: splits attention heads, MLP and the vocabulary; must divide query and key/value heads."""
    pipeline_model_parallel_size: int = 1
    """PP: splits the layers into stages; must divide the layer count."""
    micro_batch_size: int = 4
    """Responses per forward/backward pass; a mini-batch is split into micro-batches (grad accumulation)."""


@dataclass
class DataConfig:
    source: str = "word_problems"
    """Prompt source name (``nemo_sspo.data.build_prompt_source``)."""
    template: str = "chat-boxed"
    """Prompt template name (``nemo_sspo.data.render_prompt``)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Source-specific keyword arguments (e.g. ``path`` for ``jsonl``, difficulty for generators)."""


@dataclass
class RolloutConfig:
    prompts_per_step: int = 4
    """Distinct prompts sampled per training step."""
    samples_per_prompt: int = 8
    """Group size G: responses per prompt; advantages are normalised within a group."""
    max_new_tokens: int = 128
    """Response length cap in tokens; a response without EOS by then counts as truncated."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass. Keep 1.0 for training: top_p < 1 makes rollout and trainer log-probs differ."""


@dataclass
class RewardConfig:
    num_workers: int = 2
    """Processes scoring answers with math-verify (its timeouts need each worker's main thread)."""
    timeout_s: float = 5.0
    """Per-answer verification limit in seconds; a timeout scores 0."""


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """Adam learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""


@dataclass
class LossSection:
    name: str = "sspo"
    """Registered policy-loss name: grpo, gspo, sspo, sspo_fixed_clip."""
    params: dict[str, Any] = field(default_factory=dict)
    """Overrides of that loss's own config dataclass (e.g. ``gamma``, ``aggregation``)."""


@dataclass
class TrainerConfig:
    max_steps: int = 30
    """Training steps; each is one rollout of prompts_per_step x samples_per_prompt responses."""
    minibatches_per_step: int = 2
    """Optimizer steps per rollout. Above 1, later mini-batches are off-policy (ratio != 1), so clipping is active."""
    seed: int = 1234
    """Seeds data sampling, generation and model-parallel RNG."""
    output_dir: str = "outputs/sspo_smollm2_cpu"
    """metrics.jsonl, TensorBoard events, the reward/entropy plot and checkpoints go here."""
    overwrite_output_dir: bool = False
    """Allow a run to replace the metrics and checkpoints of an earlier run in ``output_dir``."""
    save_hf_checkpoint: bool = True
    """Write the final policy as a Hugging Face checkpoint to ``output_dir/hf_checkpoint`` (also on a crash)."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossSection = field(default_factory=LossSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def build_loss_config(section: LossSection) -> Any:
    """Instantiates the loss's own config dataclass from ``loss.params``.

    Raises:
        ValueError: unknown loss name (lists the registered ones) or an unknown/invalid parameter.
    """
    _, config_cls = get_policy_loss(section.name)
    try:
        return config_cls(**dict(section.params))
    except TypeError as err:
        raise ValueError(
            f"loss.params for loss '{section.name}': {err}. To switch losses select the group "
            f"(`loss={section.name}`), which replaces loss.params, rather than setting loss.name"
        ) from err


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def validate(cfg: TrainConfig, world_size: int = 1) -> None:
    """Checks that span several fields; raises ``ValueError`` naming the key path and the fix."""
    par, ro, tr = cfg.parallel, cfg.rollout, cfg.trainer
    model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
    _require(
        par.tensor_model_parallel_size >= 1 and par.pipeline_model_parallel_size >= 1,
        "parallel.tensor_model_parallel_size and parallel.pipeline_model_parallel_size must be >= 1",
    )
    _require(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size x "
        f"parallel.pipeline_model_parallel_size = {model_parallel}; change one of them or --nproc-per-node",
    )
    dp = world_size // model_parallel
    _require(ro.prompts_per_step >= 1, "rollout.prompts_per_step must be >= 1")
    _require(ro.samples_per_prompt >= 1, "rollout.samples_per_prompt must be >= 1")
    _require(
        ro.prompts_per_step % dp == 0,
        f"rollout.prompts_per_step ({ro.prompts_per_step}) must be divisible by the data-parallel size "
        f"({dp}): each data-parallel rank owns whole prompt groups",
    )
    _require(ro.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
    _require(ro.temperature > 0, "rollout.temperature must be > 0 (use a small value for near-greedy)")
    _require(0 < ro.top_p <= 1, "rollout.top_p must be in (0, 1]")
    _require(tr.max_steps >= 1, "trainer.max_steps must be >= 1")
    _require(tr.minibatches_per_step >= 1, "trainer.minibatches_per_step must be >= 1")
    _require(par.micro_batch_size >= 1, "parallel.micro_batch_size must be >= 1")
    responses = ro.prompts_per_step * ro.samples_per_prompt
    per_update = par.micro_batch_size * dp * tr.minibatches_per_step
    _require(
        responses % per_update == 0,
        f"rollout.prompts_per_step x rollout.samples_per_prompt = {responses} responses must split into "
        f"trainer.minibatches_per_step ({tr.minibatches_per_step}) x data-parallel size ({dp}) x "
        f"parallel.micro_batch_size ({par.micro_batch_size}) = {per_update}-response units",
    )
    _require(cfg.optim.lr > 0, "optim.lr must be > 0")
    _require(cfg.optim.clip_grad >= 0, "optim.clip_grad must be >= 0 (0 disables clipping)")
    _require(cfg.reward.num_workers >= 1, "reward.num_workers must be >= 1")
    _require(cfg.data.source in PROMPT_SOURCES,
             f"data.source={cfg.data.source!r} is unknown; valid: {', '.join(PROMPT_SOURCES)}")
    _require(cfg.data.template in TEMPLATES,
             f"data.template={cfg.data.template!r} is unknown; valid: {', '.join(TEMPLATES)}")
    build_loss_config(cfg.loss)


def _register() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


_register()
