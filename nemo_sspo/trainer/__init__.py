"""The GRPO training loop on a Megatron-Core policy, its typed config, plug-in loading, checkpoints and metrics."""
