"""Every Hugging Face model folder a run writes: ``hf_checkpoint`` at the end, ``best/`` on a better
evaluation, ``hf_checkpoint_interrupted`` after a failed or stopped step. All carry the run's stop list.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nemo_sspo.megatron import export_hf_state_dict
from nemo_sspo.trainer.checkpoint import INTERRUPTED_DIR, write_hf_checkpoint

__all__ = ["ModelFolders"]

logger = logging.getLogger(__name__)


class ModelFolders:
    """Writes a run's Hugging Face folders under ``trainer.output_dir`` (module docstring).

    Args:
        output_dir: the run's ``trainer.output_dir``.
        hf_config: the policy's HF config.
        tokenizer: its tokenizer (saved with every folder).
        stop_ids: the run's stop list (``nemo_sspo.trainer.setup.run_stop_ids``).
    """

    def __init__(self, output_dir: str | Path, hf_config: Any, tokenizer, stop_ids: list[int]) -> None:  # noqa: D107
        self.output_dir, self.hf_config, self.tokenizer, self.stop_ids = Path(output_dir), hf_config, tokenizer, stop_ids

    def save(self, name: str, model, src_rank: int, extra: dict | None = None) -> None:
        """The policy stage ``model``'s weights as folder ``name`` (collective export gathered on
        ``src_rank``, the replica's first model-parallel rank; global rank 0 writes). ``extra``: more
        ``trainer_state.json`` entries.
        """
        state = export_hf_state_dict(model, self.hf_config, dst_rank=src_rank)
        if dist.get_rank() == 0:
            self.write(name, state, extra)

    def save_interrupted(self, engine, backend: str) -> Path | None:
        """Rank 0 writes the rollout engine's weights (the policy of the last completed step, or of the
        abandoned one when it stopped after its refit) to ``hf_checkpoint_interrupted`` without
        collectives (other ranks may be gone); returns that folder, or None where nothing was written
        (other ranks; an engine whose weights cannot be read back, e.g. vLLM's: resume from the last
        checkpoint instead).
        """
        if dist.get_rank() != 0:
            return None
        state = engine.hf_state_dict() if engine is not None else None
        if state is None:
            logger.warning("no hf_checkpoint_interrupted: the rollout engine's weights cannot be read back "
                           "(rollout.engine.backend=%s); resume from the last checkpoint (trainer.checkpoint_interval)",
                           backend)
            return None
        return self.write(INTERRUPTED_DIR, state)

    def write(self, name: str, state: dict, extra: dict | None = None) -> Path:
        """Writes folder ``name`` from an HF state dict (every model folder of a run goes through here)."""
        return write_hf_checkpoint(self.output_dir / name, self.hf_config, state, self.tokenizer, extra,
                                   stop_ids=self.stop_ids)
