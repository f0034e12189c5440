"""``optim`` (and ``critic.optim``): the Adam optimizer, with the section's own invariants."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nemo_sspo.megatron.lr_schedule import LrSchedule
from nemo_sspo.trainer.config.keyed import failed

__all__ = ["OptimConfig"]


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
    lr_schedule: LrSchedule = LrSchedule.constant
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

    def problems(self, key: str) -> list[str]:
        """Learning rate, schedule, clipping and the distributed optimizer.

        Args:
            key: the section's key path (``optim`` or ``critic.optim``).

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        return failed(
            (0 < self.lr < math.inf, f"{key}.lr={self.lr} must be > 0 and finite"),
            (self.clip_grad >= 0, f"{key}.clip_grad must be >= 0 (0 disables clipping)"),
            (self.lr_warmup_steps >= 0, f"{key}.lr_warmup_steps={self.lr_warmup_steps} must be >= 0"),
            (self.lr_decay_steps is None or self.lr_decay_steps > self.lr_warmup_steps,
             f"{key}.lr_decay_steps={self.lr_decay_steps} must exceed {key}.lr_warmup_steps="
             f"{self.lr_warmup_steps} (the decay steps count the warmup), or be null for the whole run"),
            (not 0 < self.lr < math.inf or 0 <= self.min_lr <= self.lr,  # only against a valid lr
             f"{key}.min_lr={self.min_lr} must be in [0, {key}.lr={self.lr}]"),
            (self.use_distributed_optimizer or not self.cpu_offload,
             f"{key}.cpu_offload=true needs {key}.use_distributed_optimizer=true (megatron-core offloads the "
             "distributed optimizer's states)"),
        )
