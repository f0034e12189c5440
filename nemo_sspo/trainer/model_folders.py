"""Every Hugging Face model folder a run writes: ``hf_checkpoint`` at the end, ``best/`` on a better
evaluation, ``hf_checkpoint_interrupted`` after a failed or stopped step. All carry the run's stop list;
under LoRA the weights are merged and the folders written from the policy also hold its adapters in
the ``peft`` format (``adapter/``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nemo_sspo.megatron import export_hf_adapters, export_hf_state_dict
from nemo_sspo.megatron.lora import LoraSettings
from nemo_sspo.models.hf_folder import PeftAdapter
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
        lora: the policy's adapters (``nemo_sspo.trainer.setup.lora_settings``), or None.
        base_model: ``model.source``, named in the adapter folder as its base model.
    """

    def __init__(self, output_dir: str | Path, hf_config: Any, tokenizer, stop_ids: list[int], *,  # noqa: D107
                 lora: LoraSettings | None = None, base_model: str = "") -> None:
        self.output_dir, self.hf_config, self.tokenizer, self.stop_ids = Path(output_dir), hf_config, tokenizer, stop_ids
        self.lora, self.base_model = lora, base_model

    def save(self, name: str, model, src_rank: int, extra: dict | None = None) -> None:
        """The policy stage ``model``'s weights as folder ``name`` (collective export gathered on
        ``src_rank``, the replica's first model-parallel rank; global rank 0 writes). ``extra``: more
        ``trainer_state.json`` entries.
        """
        state = export_hf_state_dict(model, self.hf_config, dst_rank=src_rank)
        adapter = None
        if self.lora is not None:
            adapter = PeftAdapter(export_hf_adapters(model, self.hf_config, dst_rank=src_rank), rank=self.lora.rank,
                                  alpha=self.lora.alpha, dropout=self.lora.dropout, base_model=self.base_model)
        if dist.get_rank() == 0:
            self.write(name, state, extra, adapter=adapter)

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

    def write(self, name: str, state: dict, extra: dict | None = None, *, adapter: PeftAdapter | None = None) -> Path:
        """Writes folder ``name`` from an HF state dict (every model folder of a run goes through here),
        with ``adapter`` as ``name/adapter``.
        """
        return write_hf_checkpoint(self.output_dir / name, self.hf_config, state, self.tokenizer, extra,
                                   stop_ids=self.stop_ids, adapter=adapter)
