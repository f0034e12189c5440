"""Throughput a user can compare: tokens per second, model FLOPs and MFU of a training step.

Model FLOPs (ours, following the matmul accounting of Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters", section 5.1, with causal attention counted
exactly). A multiply-add is 2 FLOPs. For a decoder with ``L`` layers, hidden size ``h``, ``n_q``
query heads and ``n_kv`` key/value heads of size ``d``, a gated MLP of width ``f`` (SwiGLU: gate,
up and down projections) and vocabulary ``V``, one forward pass over a sequence of ``s`` tokens of
which ``r`` have their logits computed costs::

    linear    = 2 * s * L * (h*n_q*d + 2*h*n_kv*d + n_q*d*h + 3*h*f)     # q, k, v, o, MLP
    attention = 2 * 2 * L * n_q * d * s*(s+1)/2                            # QK^T and AV, causal pairs
    logits    = 2 * r * h * V                                             # output layer

A mixture-of-experts layer replaces the ``3*h*f`` of its MLP by the work of the experts a token
actually visits (its *active* parameters, the count MoE model cards publish, e.g. Qwen3-30B-A3B's
"3.3B activated" of 30.5B): its router ``h*E`` (logits over ``E`` experts), ``k`` routed
experts of width ``f_e`` (``3*h*f_e`` each, SwiGLU) and, where the model has them, shared experts
of total width ``f_s`` (``3*h*f_s``, plus a ``h*1`` gate on Qwen2-MoE's). Which layers are sparse
follows the HF config (``decoder_sparse_step``, ``mlp_only_layers``, as HF's Qwen-MoE decoders
choose them); the others stay dense with width ``f``::

    moe_mlp   = h*E + k*3*h*f_e + 3*h*f_s (+ h with a shared-expert gate)  # per token, per sparse layer

Expert parallelism moves the expert work between ranks but does not change it, and the tokens
padded into an expert's capacity are not model work (our dispatcher drops none and adds none).

Biases, norms, rotary embeddings and the softmax are left out (they are not matmuls); the
embedding lookup costs nothing. A backward pass costs twice its forward (gradients of the
activations and of the weights), so a training pass is 3x. Activation recomputation is not
counted: these are model FLOPs, not hardware FLOPs, so MFU does not grow with recomputation.

Generation with a KV cache costs one forward pass over each finished sequence (:func:`step_work_sums`).

MFU = model FLOPs / (seconds x GPUs x peak FLOP/s), for the run (both sides' FLOPs over the step and
every GPU of the run, rollout ranks included) and for each side separately (the training phase on
the training GPUs; generation over its own window on the GPUs that generate). The peak is
the dense (no sparsity) tensor-core figure of the device's datasheet for the run's precision
(:data:`PEAK_TFLOPS`), or ``$NEMO_SSPO_PEAK_TFLOPS`` (TFLOP/s per device), which overrides it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from nemo_sspo.metrics import MetricPair, mean_pair

__all__ = [
    "ModelShape",
    "PEAK_TFLOPS",
    "PEAK_TFLOPS_ENV",
    "forward_flops",
    "peak_tflops",
    "step_work_sums",
    "summarize_throughput",
    "throughput_metrics",
]

PEAK_TFLOPS_ENV = "NEMO_SSPO_PEAK_TFLOPS"

# Dense tensor-core peaks in TFLOP/s per GPU, (bf16, fp8), from NVIDIA's datasheets, whose figures
# are "with sparsity" (halved here): H100 Tensor Core GPU datasheet (SXM: BF16 1,979, FP8 3,958;
# PCIe: 1,513 / 3,026; NVL: 1,671 / 3,341), H200 Tensor Core GPU datasheet (SXM: 1,979 / 3,958; NVL:
# 1,671 / 3,341), DGX/HGX B200 datasheet (per GPU: BF16 4.5 PF, FP8 9 PF). Ordered: the first name
# that ``torch.cuda.get_device_name`` contains wins ("H100 PCIe" before "H100").
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H100 NVL", 835.5, 1670.5),
    ("H100 PCIe", 756.5, 1513.0),
    ("H100", 989.5, 1979.0),
    ("H200 NVL", 835.5, 1670.5),
    ("H200", 989.5, 1979.0),
    ("B200", 2250.0, 4500.0),
)


@dataclass(frozen=True)
class ModelShape:
    """The layer sizes that set a decoder's matmul FLOPs (module docstring).

    Attributes:
        num_layers: L, transformer layers.
        hidden_size: h.
        num_heads: n_q, query heads.
        num_kv_heads: n_kv, key/value heads (grouped-query attention).
        head_dim: d, size of one head.
        ffn_size: f, width of the gated MLP of the dense layers.
        vocab_size: V, rows of the output layer.
        moe_layers: layers whose MLP is a mixture of experts (0: a dense model).
        num_experts: E, routed experts of a sparse layer (the router's outputs).
        moe_top_k: k, experts each token visits.
        moe_ffn_size: f_e, width of one routed expert.
        shared_ffn_size: f_s, total width of the shared experts every token visits (0: none).
        shared_expert_gate: a ``h -> 1`` sigmoid gate scales the shared experts (Qwen2-MoE).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    moe_layers: int = 0
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_size: int = 0
    shared_ffn_size: int = 0
    shared_expert_gate: bool = False

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        """The shape of a Hugging Face Llama/Qwen2/Qwen3 or Qwen-MoE config (``head_dim`` defaults
        to h / n_q).

        Args:
            config: a ``PretrainedConfig`` with ``num_hidden_layers``, ``hidden_size``,
                ``num_attention_heads``, ``num_key_value_heads`` (optional), ``intermediate_size``
                and ``vocab_size``; a mixture-of-experts config also has ``num_experts`` (or
                ``num_local_experts``) > 0, ``num_experts_per_tok``, ``moe_intermediate_size`` and
                optionally ``decoder_sparse_step``, ``mlp_only_layers`` and
                ``shared_expert_intermediate_size`` (Qwen2-MoE, gated) or ``n_shared_experts``
                (DeepSeek-style, ungated, each of width ``moe_intermediate_size``).

        Returns:
            The :class:`ModelShape`; layer ``i`` is sparse when ``i`` is not in ``mlp_only_layers``
            and ``(i + 1) % decoder_sparse_step == 0`` (HF's Qwen-MoE rule).
        """
        heads = config.num_attention_heads
        shape = dict(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
                     num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                     head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                     ffn_size=config.intermediate_size, vocab_size=config.vocab_size)
        experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)
        if experts:
            step = int(getattr(config, "decoder_sparse_step", None) or 1)
            dense = set(getattr(config, "mlp_only_layers", None) or [])
            gated = int(getattr(config, "shared_expert_intermediate_size", None) or 0)
            ungated = int(getattr(config, "n_shared_experts", None) or 0) * int(config.moe_intermediate_size)
            shape.update(moe_layers=sum(1 for i in range(config.num_hidden_layers)
                                        if i not in dense and (i + 1) % step == 0),
                         num_experts=experts, moe_top_k=int(config.num_experts_per_tok),
                         moe_ffn_size=int(config.moe_intermediate_size), shared_ffn_size=gated + ungated,
                         shared_expert_gate=gated > 0)
        return cls(**shape)

    def linear_flops_per_token(self) -> int:
        """Forward FLOPs of one token through every layer's q, k, v, o and MLP matmuls (a sparse
        layer's MLP: router, the ``k`` routed experts and the shared experts; module docstring).
        """
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        sparse = (h * self.num_experts + self.moe_top_k * 3 * h * self.moe_ffn_size
                  + 3 * h * self.shared_ffn_size + (h if self.shared_expert_gate else 0))
        dense_layers = self.num_layers - self.moe_layers
        return 2 * (self.num_layers * attention + dense_layers * 3 * h * self.ffn_size + self.moe_layers * sparse)


def forward_flops(shape: ModelShape, seq_lengths: torch.Tensor, logit_tokens: int) -> float:
    """Model FLOPs of one forward pass (module docstring's equations).

    Args:
        shape: the model's :class:`ModelShape`.
        seq_lengths: ``[B]`` integer tensor, tokens of each sequence (prompt + response, no
            padding: padding is not model work).
        logit_tokens: tokens whose output-layer logits are computed (the response tokens the loss
            reads).

    Returns:
        FLOPs as a float (exact below 2**53).
    """
    s = seq_lengths.to(torch.float64)
    pairs = float((s * (s + 1) / 2).sum())
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * pairs
    linear = shape.linear_flops_per_token() * float(s.sum())
    return linear + attention + 2.0 * logit_tokens * shape.hidden_size * shape.vocab_size


def peak_tflops(device_name: str | None, precision: str, fp8: bool) -> float | None:
    """A device's dense peak in TFLOP/s for the run's matmul precision, or None when unknown.

    Args:
        device_name: ``torch.cuda.get_device_name()``, or None without a GPU.
        precision: ``model.precision``; only ``bf16`` has a table entry (fp32/fp16 need the env var).
        fp8: whether FP8 GEMMs are on (``model.fp8``): the FP8 column.

    Returns:
        ``$NEMO_SSPO_PEAK_TFLOPS`` when set, else the :data:`PEAK_TFLOPS` entry, else None.

    Raises:
        ValueError: ``NEMO_SSPO_PEAK_TFLOPS`` is not a positive number.
    """
    override = os.environ.get(PEAK_TFLOPS_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            value = math.nan
        if not value > 0 or math.isinf(value):
            raise ValueError(f"{PEAK_TFLOPS_ENV}={override!r} must be a positive number of TFLOP/s per device "
                             "(e.g. 989.5 for an H100 SXM in bf16), or unset to use the built-in table")
        return value
    if device_name is None or (precision != "bf16" and not fp8):
        return None
    for name, bf16_peak, fp8_peak in PEAK_TFLOPS:
        if name in device_name:
            return fp8_peak if fp8 else bf16_peak
    return None


def step_work_sums(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, shape: ModelShape, *,
                   forward_passes: int) -> dict[str, MetricPair]:
    """One data-parallel rank's token and FLOP counts of a step, as ``"mean"`` pairs of count 1.

    Reduced over data-parallel ranks a pair's value is the mean per rank; :func:`throughput_metrics`
    multiplies it by the data-parallel size to get the step's total.

    Generation with a KV cache does the matmul work of one forward pass over each finished sequence
    (every token's projections once, each causal pair of QK^T and AV once) with logits only for the
    response tokens, so ``flops/generation`` is one :func:`forward_flops` (ours; it also counts the
    last sampled token, which the engine never feeds back: one token per response). It counts the
    trained rollout's responses: groups that dynamic sampling discarded and rollouts dropped for
    staleness were generated too, but are not counted.

    Args:
        prompt_lengths: ``[B]`` integer tensor, prompt tokens of each of this rank's responses.
        response_lengths: ``[B]`` integer tensor, response tokens of each.
        shape: the policy's :class:`ModelShape`.
        forward_passes: forward-pass equivalents of the training phase over the batch: 1 (old-policy
            log-probs) + 1 with a reference policy + 3 (the update's forward and backward).

    Returns:
        ``tokens/prompt``, ``tokens/response``, ``flops/train`` and ``flops/generation`` pairs.
    """
    responses = int(response_lengths.sum())
    one_pass = forward_flops(shape, prompt_lengths + response_lengths, responses)
    return {"tokens/prompt": mean_pair(float(prompt_lengths.sum()), 1.0),
            "tokens/response": mean_pair(float(responses), 1.0),
            "flops/train": mean_pair(forward_passes * one_pass, 1.0),
            "flops/generation": mean_pair(one_pass, 1.0)}


def throughput_metrics(metrics: dict[str, float], *, dp_size: int, training_gpus: int, rollout_gpus: int | None,
                       peak: float | None) -> dict[str, float]:
    """Per-step throughput of the whole run and of each side, from the reduced work counts and timings.

    The training side is timed by ``timing/train_s`` on its GPUs; the rollout side by its own
    generation window ``timing/rollout_generation_s`` on the GPUs that generate (with
    ``rollout.schedule.placement: separate`` the rollout ranks, concurrent with training; colocated the
    training GPUs themselves). The run's figures divide the step's tokens and FLOPs (both sides) by
    ``timing/step_s`` and every GPU of the run.

    Args:
        metrics: the step's reduced metrics with ``tokens/prompt``, ``tokens/response``,
            ``flops/train``, ``flops/generation`` (per-rank means, :func:`step_work_sums`),
            ``timing/rollout_generation_s``, ``timing/train_s`` and ``timing/step_s``.
        dp_size: data-parallel size (the number of ranks whose counts were averaged).
        training_gpus: GPUs (processes) that train.
        rollout_gpus: GPUs of the rollout ranks (separate placement), or None when the engine
            generates on the training GPUs (colocated).
        peak: dense peak TFLOP/s per device (:func:`peak_tflops`); None leaves out the MFUs.

    Returns:
        ``tokens/prompt``, ``tokens/response``, ``flops/train`` and ``flops/generation`` as step
        totals. The run: ``throughput/tokens_per_s_per_gpu`` (prompt + response tokens per second of
        the step per GPU of the run, NeMo-RL's convention), ``throughput/tflops_per_gpu`` and
        ``throughput/mfu`` (both sides' FLOPs over the step and every GPU; a fraction, not percent).
        The training side: ``throughput/train_tokens_per_s`` (total),
        ``throughput/train_tokens_per_s_per_gpu``, ``throughput/train_tflops_per_gpu``,
        ``throughput/train_mfu``. The rollout side: ``throughput/generation_tokens_per_s``
        (response tokens of all replicas per second of generation), ``..._per_gpu``,
        ``throughput/generation_tflops_per_gpu``, ``throughput/generation_mfu``. A generation
        window of 0 s (nothing generated in the step) leaves out the rollout side's rates.
    """
    totals = {key: metrics[key] * dp_size
              for key in ("tokens/prompt", "tokens/response", "flops/train", "flops/generation")}
    tokens = totals["tokens/prompt"] + totals["tokens/response"]
    generating_gpus = training_gpus if rollout_gpus is None else rollout_gpus
    all_gpus = training_gpus if rollout_gpus is None else training_gpus + rollout_gpus
    train_s, generation_s, step_s = (metrics[f"timing/{k}_s"] for k in ("train", "rollout_generation", "step"))
    tflops = {"": (totals["flops/train"] + totals["flops/generation"]) / step_s / all_gpus / 1e12,
              "train_": totals["flops/train"] / train_s / training_gpus / 1e12}
    out = {**totals,
           "throughput/tokens_per_s_per_gpu": tokens / step_s / all_gpus,
           "throughput/train_tokens_per_s": tokens / train_s,
           "throughput/train_tokens_per_s_per_gpu": tokens / train_s / training_gpus}
    if generation_s > 0:
        rate = totals["tokens/response"] / generation_s
        out.update({"throughput/generation_tokens_per_s": rate,
                    "throughput/generation_tokens_per_s_per_gpu": rate / generating_gpus})
        tflops["generation_"] = totals["flops/generation"] / generation_s / generating_gpus / 1e12
    for side, value in tflops.items():
        out[f"throughput/{side}tflops_per_gpu"] = value
        if peak is not None:
            out[f"throughput/{side}mfu"] = value / peak
    return out


RUN_SUMMARY_KEYS = tuple(f"throughput/{side}{figure}" for side in ("", "train_", "generation_")
                         for figure in ("tokens_per_s_per_gpu", "tflops_per_gpu", "mfu")) + (
    "throughput/generation_tokens_per_s", "throughput/train_tokens_per_s", "timing/step_s", "timing/generation_s",
    "timing/rollout_generation_s", "timing/train_s", "timing/refit_s", "memory/peak_allocated_gib")


def summarize_throughput(history: list[dict[str, float]]) -> dict[str, float]:
    """Means over a run's steps of its throughput, timing and memory metrics.

    The first step is left out when there are more (it holds one-time costs: CUDA graph capture,
    allocator growth, kernel autotuning); ``memory/peak_allocated_gib`` is the maximum, not the mean.

    Args:
        history: the per-step records (``MetricsLogger.history``).

    Returns:
        ``summary/<key>`` for each :data:`RUN_SUMMARY_KEYS` entry present in every counted step, plus
        ``summary/steps`` (the steps counted); {} for an empty history.
    """
    steps = history[1:] if len(history) > 1 else history
    out: dict[str, float] = {}
    for key in RUN_SUMMARY_KEYS:
        values = [record[key] for record in steps if key in record]
        if values and len(values) == len(steps):
            reduce = max if key.startswith("memory/") else (lambda v: sum(v) / len(v))
            out[f"summary/{key}"] = float(reduce(values))
    if out:
        out["summary/steps"] = float(len(steps))
    return out
