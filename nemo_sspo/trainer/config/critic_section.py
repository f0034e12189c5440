"""``critic``: the SPPO critic, with the section's own invariants."""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_sspo.trainer.config.keyed import failed
from nemo_sspo.trainer.config.optim_section import OptimConfig

__all__ = ["CriticConfig"]


@dataclass
class CriticConfig:
    """``critic``: the SPPO critic (read with ``advantage.name=critic``, which ``loss=sppo`` resolves to)."""

    source: str | None = None
    """Checkpoint of the SPPO critic's trunk (as ``model.source``; same tokenizer as the policy); null =
    ``model.source``. Read only with ``advantage.name=critic`` (``loss=sppo``)."""
    num_layers: int | None = None
    """Keep only the first N decoder layers of ``source`` (a smaller critic); null = all of them."""
    micro_batch_size: int = 2
    """Prompts per critic forward/backward pass; must divide the prompts per data-parallel rank."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's own Adam optimizer (one step per training step, on that step's prompts)."""

    def problems(self, key: str) -> list[str]:
        """The layer count, the micro-batch size and the critic's optimizer.

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        return [
            *failed((self.num_layers is None or self.num_layers >= 1,
                     f"{key}.num_layers must be >= 1, or null for all")),
            *self.optim.problems(f"{key}.optim"),
        ]
