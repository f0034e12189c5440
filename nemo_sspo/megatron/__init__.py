"""Megatron-Core adapter: parallel setup, GPTModel from HF Llama / Qwen2 / Qwen3 / Qwen3-MoE configs (local spec on CPU,
TransformerEngine spec on GPU), HF<->Megatron weights.

Only this package (and the trainer) reads Megatron's global ``parallel_state``; functions in
``nemo_sspo.parallel`` get explicit groups from ``get_parallel_groups()``. All CPU-only
workarounds live in ``cpu_shims`` and are inert when a GPU is present. Megatron-Core itself is
imported lazily, so importing this package is cheap.
"""

from nemo_sspo.megatron.cpu_shims import apply_cpu_shims, cpu_device_context, needs_cpu_shims
from nemo_sspo.megatron.hf_mapping import (
    export_hf_adapters,
    export_hf_state_dict,
    iter_hf_weight_buckets,
    load_hf_into_megatron,
)
from nemo_sspo.megatron.model import (
    build_policy_model,
    forward_hidden,
    forward_logits,
    output_weight,
    padded_vocab_size,
    parameter_counts,
    resolve_transformer_impl,
    transformer_config_from_hf,
    unwrap_model,
    vocab_shard,
)
from nemo_sspo.megatron.weight_export import AdapterExporter, WeightExporter
from nemo_sspo.megatron.parallel_setup import (
    ParallelGroups,
    destroy_parallel,
    get_parallel_groups,
    initialize_parallel,
)

__all__ = [
    "AdapterExporter",
    "ParallelGroups",
    "WeightExporter",
    "apply_cpu_shims",
    "build_policy_model",
    "cpu_device_context",
    "destroy_parallel",
    "export_hf_adapters",
    "export_hf_state_dict",
    "iter_hf_weight_buckets",
    "forward_hidden",
    "forward_logits",
    "get_parallel_groups",
    "initialize_parallel",
    "load_hf_into_megatron",
    "needs_cpu_shims",
    "output_weight",
    "padded_vocab_size",
    "parameter_counts",
    "resolve_transformer_impl",
    "transformer_config_from_hf",
    "unwrap_model",
    "vocab_shard",
]
