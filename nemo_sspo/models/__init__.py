"""Model sources: Hugging Face checkpoints (GGUF-backed SmolLM2, tiny random Llama) and builders."""

from nemo_sspo.models.hf_checkpoint import (
    SOURCES,
    build_hf_model,
    default_cache_root,
    load_hf_checkpoint,
    load_hf_config,
)

__all__ = ["SOURCES", "build_hf_model", "default_cache_root", "load_hf_checkpoint", "load_hf_config"]
