"""``model``: the checkpoint and the policy's precision, with the section's own invariants."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nemo_sspo.megatron.lora import LoraRefit, LoraTarget
from nemo_sspo.megatron.model import Fp8Recipe, Precision, TransformerImpl, check_model_options
from nemo_sspo.megatron.router_replay import RouterReplay, check_router_replay
from nemo_sspo.parallel.fused_output import OutputPrecision
from nemo_sspo.trainer.config.keyed import failed, problems_at_key

__all__ = ["LoraConfig", "ModelConfig"]


@dataclass
class LoraConfig:
    """``model.lora``: low-rank adapters on the policy's linear layers (:mod:`nemo_sspo.megatron.lora`).

    With ``rank >= 1`` only the adapters train: every base weight is frozen (no gradient, no
    optimizer state), a KL term's reference is the base model (the policy with its adapters off,
    no second model), and every refit and exported Hugging Face checkpoint carries the merged
    weights ``W + (alpha / rank) B A``. ``A`` starts at random (Kaiming-uniform, as ``peft``), ``B``
    at zero, so step 0 is the base model. Schulman et al., "LoRA Without Regret" (2025): in
    policy-gradient RL, LoRA matches full fine-tuning even at rank 1 when every linear layer,
    MLP included, has an adapter, at about 10x the full fine-tuning learning rate.
    """

    rank: int = 0
    """r, the adapters' inner dimension; 0 = no adapters (full fine-tuning)."""
    alpha: float = 32.0
    """The adapters' output is scaled by ``alpha / rank`` (Hu et al. 2021, section 4.1)."""
    dropout: float = 0.0
    """Dropout on each adapter's input in the training forwards (forward-only passes never drop), in [0, 1)."""
    target: list[LoraTarget] = field(default_factory=lambda: list(LoraTarget))
    """The linear layers of each decoder layer that get an adapter, by megatron-core name (default:
    all four: ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``)."""
    refit: LoraRefit = LoraRefit.merged
    """What a refit sends the rollout engine: ``merged`` (every weight, ``W + (alpha / rank) B A``; any
    engine) or ``adapters`` (the adapters alone, which vLLM applies to the base model it loaded as a
    LoRA adapter; ``rollout.engine.backend=vllm``)."""

    def problems(self, key: str) -> list[str]:
        """The section's own invariants.

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        return failed(
            (self.rank >= 0, f"{key}.rank={self.rank} must be >= 0 (0 = full fine-tuning, no adapters)"),
            (math.isfinite(self.alpha) and self.alpha > 0,
             f"{key}.alpha={self.alpha} must be a finite number > 0 (the adapters' scale is alpha / rank)"),
            (0 <= self.dropout < 1, f"{key}.dropout={self.dropout} must be in [0, 1)"),
            (len(self.target) > 0, f"{key}.target is empty: name at least one of {[t.value for t in LoraTarget]}, "
                                   f"or set {key}.rank=0 for full fine-tuning"),
            (len(set(self.target)) == len(self.target), f"{key}.target={[str(t) for t in self.target]} names a layer "
                                                       "twice; name each once"),
        )


@dataclass
class ModelConfig:
    """``model``: the checkpoint and the policy's precision."""

    source: str = "smollm2-135m-instruct"
    """Checkpoint to start from: a built-in name (``nemo_sspo.models.SOURCES``), a local Hugging Face
    model directory, or a hub id (``Qwen/Qwen2.5-Math-1.5B``) found in the local HF cache."""
    cache_dir: str | None = None
    """Where dequantised weights are cached; None = ``$NEMO_SSPO_CACHE`` or ``~/.cache/nemo_sspo``."""
    precision: Precision = Precision.fp32
    """Policy parameter dtype: ``fp32`` (CPU, exact tests) or ``bf16`` (GPU training)."""
    output_layer_precision: OutputPrecision = OutputPrecision.auto
    """Precision of the output layer's matmul (hidden states x output weight -> logits) on the trainer's
    fused log-prob path and in the ``hf`` rollout engine: ``auto`` (today's behaviour: the model's
    precision, i.e. bf16 logits for a bf16 policy), ``bf16``, ``tf32`` (fp32 inputs, TF32 tensor-core
    matmul on CUDA; plain fp32 on CPU) or ``fp32``. Wider logits cut the trainer/engine log-prob gap at
    its source (bf16 rounding of logits dominates it). Needs ``parallel.output_chunk_size`` (the fused
    path). vLLM: ``bf16`` / ``fp32`` set its ``head_dtype`` (``hf_overrides``; on CUDA an fp32 head
    accumulates bf16 inputs into fp32 logits), ``tf32`` is refused."""
    fp8: str | None = None
    """FP8 GEMMs through TransformerEngine: null (off), ``hybrid`` or ``e4m3``; needs precision=bf16."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.delayed
    """FP8 scaling recipe when ``fp8`` is set: delayed, tensorwise, mxfp8 (Blackwell), blockwise."""
    transformer_impl: TransformerImpl = TransformerImpl.auto
    """Layer implementation: ``auto`` (TransformerEngine when CUDA and transformer-engine are present,
    else local), ``local`` or ``transformer_engine`` (fails clearly when unavailable)."""
    router_replay: RouterReplay = RouterReplay.none
    """Mixture-of-experts models: ``none`` (every forward routes with its own routers), ``r2`` (the
    training forwards route each token to the experts the old-policy forward chose) or ``r3`` (the
    old-policy, reference and training forwards route each token to the experts the rollout engine
    chose for it; needs ``rollout.engine.backend=hf`` and ``rollout.schedule.placement=colocated``);
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

    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (:class:`LoraConfig`); ``rank: 0`` (the default) trains every weight."""

    def problems(self, key: str) -> list[str]:
        """The section's own invariants (names and ranges).

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        return [
            *problems_at_key(f"{key}.", lambda: check_model_options(
                precision=self.precision, fp8=self.fp8, fp8_recipe=self.fp8_recipe,
                transformer_impl=self.transformer_impl)),
            *problems_at_key(f"{key}.", lambda: check_router_replay(self.router_replay)),
            *self.lora.problems(f"{key}.lora"),
            *failed((self.lora.rank == 0 or self.transformer_impl != "transformer_engine",
                     f"{key}.lora.rank={self.lora.rank} builds adapters on the local layer spec only so far, but "
                     f"{key}.transformer_impl='transformer_engine'; set {key}.transformer_impl=local")),
            *failed(
                (self.routing_agreement_interval >= 0,
                 f"{key}.routing_agreement_interval={self.routing_agreement_interval} must be >= 0 (0 = never)"),
                (self.router_aux_loss_coef >= 0,
                 f"{key}.router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0 (0 turns the "
                 "load-balancing loss off)"),
            ),
        ]
