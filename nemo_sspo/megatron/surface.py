"""Every megatron-core name the product touches, in one place beside the CPU shims.

The table below lists each module, class or function of ``megatron.core`` that any module of
nemo_sspo imports or reads (``tests/unit/megatron/test_megatron_surface.py`` scans the package and fails when
the table and the code differ, either way), with what it is used for. Names starting with an
underscore are megatron-core internals: only the CPU shims (:mod:`nemo_sspo.megatron.cpu_shims`)
touch them, each replaced on a CPU-only host and never on a GPU one. Everything else is API that
megatron-core 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12) both provide with the same signatures;
an upgrade checks this list first.
"""

from __future__ import annotations

__all__ = ["MEGATRON_SURFACE"]

MEGATRON_SURFACE: dict[str, str] = {
    # parallel state and groups (nemo_sspo.megatron.parallel_setup; the NeMo-RL adapter reads its host's)
    "megatron.core.parallel_state": "the model-parallel groups' one reader (parallel_setup, model, sequence_parallel, "
                                    "the NeMo-RL adapter)",
    "megatron.core.parallel_state.initialize_model_parallel": "TP x PP x EP x CP groups",
    "megatron.core.parallel_state.destroy_model_parallel": "tear-down",
    "megatron.core.parallel_state.model_parallel_is_initialized": "guards against a second set-up",
    "megatron.core.parallel_state.get_context_parallel_rank": "the CP split of a micro-batch",
    "megatron.core.parallel_state.get_context_parallel_world_size": "NeMo-RL adapter: its CP size",
    "megatron.core.parallel_state.get_tensor_model_parallel_group": "NeMo-RL adapter: its TP group",
    "megatron.core.parallel_state.get_tensor_model_parallel_rank": "sequence-parallel norms; NeMo-RL adapter",
    "megatron.core.parallel_state.get_tensor_model_parallel_world_size": "NeMo-RL adapter: its TP size",
    "megatron.core.process_groups_config.ProcessGroupCollection": "the groups ParallelGroups carries",
    "megatron.core.tensor_parallel.model_parallel_cuda_manual_seed": "per-TP-rank RNG streams",
    "megatron.core.tensor_parallel.gather_from_sequence_parallel_region": "sequence-parallel norms' input",
    "megatron.core.tensor_parallel.random.get_cuda_rng_tracker": "checkpointed RNG states",
    # the model
    "megatron.core.models.gpt.GPTModel": "the policy, reference and value models",
    "megatron.core.models.gpt.gpt_layer_specs": "the layer specs (local on CPU, TransformerEngine on GPU)",
    "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec": "the local layer spec",
    "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec": "the TE layer spec",
    "megatron.core.transformer.transformer_config.TransformerConfig": "the model's config from the HF config",
    "megatron.core.transformer.transformer_block.TransformerBlockSubmodules": "per-layer specs (MoE layers)",
    "megatron.core.transformer.transformer_block.get_num_layers_to_build": "layers of a pipeline stage",
    "megatron.core.transformer.identity_op.IdentityOp": "spec slots left empty (q/k norms off)",
    "megatron.core.transformer.module.Float16Module": "bf16/fp16 wrapping, unwrapped for exports",
    "megatron.core.transformer.utils.sharded_state_dict_default": "the value head's checkpoint entries",
    "megatron.core.transformer.moe.router.TopKRouter": "router replay and routing metrics",
    "megatron.core.transformer.moe.router_replay.RouterReplayAction": "router replay (R2 record, R3 replay)",
    "megatron.core.transformer.moe.token_dispatcher.MoEAllGatherTokenDispatcher": "MoE dispatch on CPU",
    # LoRA adapters (nemo_sspo.megatron.lora): subclasses of the local spec's linear layers
    "megatron.core.tensor_parallel.layers.ColumnParallelLinear": "LoRA: base of the column-parallel adapter layer",
    "megatron.core.tensor_parallel.layers.RowParallelLinear": "LoRA: base of the row-parallel adapter layer",
    "megatron.core.tensor_parallel.layers.set_tensor_model_parallel_attributes": "LoRA: the split factor's TP "
                                                                                "attributes (gradient norm, checkpoints)",
    "megatron.core.tensor_parallel.mappings.copy_to_tensor_model_parallel_region": "LoRA: column adapter's input",
    "megatron.core.tensor_parallel.mappings.gather_from_sequence_parallel_region": "LoRA: column adapter under SP",
    "megatron.core.tensor_parallel.mappings.reduce_from_tensor_model_parallel_region": "LoRA: row adapter's sum",
    "megatron.core.tensor_parallel.mappings.reduce_scatter_to_sequence_parallel_region": "LoRA: row adapter under SP",
    "megatron.core.transformer.spec_utils.ModuleSpec": "LoRA: adapter layers with their settings in the spec",
    "megatron.core.transformer.utils.make_sharded_tensors_for_checkpoint": "LoRA: the adapters' checkpoint entries",
    "megatron.core.packed_seq_params.PackedSeqParams": "packed (THD) micro-batches",
    "megatron.core.fp8_utils.get_fp8_align_size": "packed rows' alignment under FP8",
    # training
    "megatron.core.distributed.DistributedDataParallel": "gradient buffers and reduction",
    "megatron.core.distributed.DistributedDataParallelConfig": "its settings",
    "megatron.core.distributed.finalize_model_grads.finalize_model_grads": "gradient all-reduce before a step",
    "megatron.core.optimizer.OptimizerConfig": "Adam settings",
    "megatron.core.optimizer.get_megatron_optimizer": "Adam, plain or distributed",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer": "its sharded checkpoint states",
    "megatron.core.optimizer_param_scheduler.OptimizerParamScheduler": "the learning-rate schedule",
    "megatron.core.pipeline_parallel.get_forward_backward_func": "the pipeline schedules",
    "megatron.core.utils.get_model_config": "the schedules' config",
    "megatron.core.dist_checkpointing": "sharded checkpoints",
    "megatron.core.dist_checkpointing.save": "checkpoint save",
    "megatron.core.dist_checkpointing.load": "checkpoint load",
    # CPU shims: modules whose attributes are replaced on a CPU-only host (cpu_shims docstring, by number)
    "megatron.core.optimizer.optimizer": "shim 6's module",
    "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32": "shim 6: asserts CUDA gradients",
    "megatron.core.tensor_parallel.random": "shim 2's module",
    "megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER": "shim 2 (internal): the CPU RNG tracker",
    "megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER_INITIALIZED": "shim 2 (internal)",
    "megatron.core.tensor_parallel.random._get_cuda_rng_state": "shim 2 (internal): no CUDA generator",
    "megatron.core.tensor_parallel.random._set_cuda_rng_state": "shim 2 (internal): no CUDA generator",
    "megatron.core.transformer.moe.moe_utils": "shim 7's module",
    "megatron.core.transformer.moe.moe_utils.te_general_gemm": "shim 7: None without TransformerEngine",
}
"""Dotted megatron-core name -> what the product uses it for (module docstring)."""
