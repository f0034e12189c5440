"""Model sources: Hugging Face checkpoints (GGUF-backed SmolLM2, tiny random Llama) and builders."""

from nemo_sspo.models.hf_checkpoint import (
    SOURCES,
    build_hf_model,
    default_cache_root,
    load_hf_checkpoint,
    load_hf_config,
)
from nemo_sspo.models.moe_weights import fuse_expert_weights, split_expert_weights

__all__ = [
    "SOURCES",
    "build_hf_model",
    "default_cache_root",
    "fuse_expert_weights",
    "load_hf_checkpoint",
    "load_hf_config",
    "split_expert_weights",
]
