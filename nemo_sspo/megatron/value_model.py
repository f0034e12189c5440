"""SPPO's value model: a Megatron ``GPTModel`` whose last stage ends in a scalar head.

The critic (arXiv 2604.08865) is its own Megatron ``GPTModel`` in the policy's parallel layout (TP
shards, PP stages, DP replicas with Megatron DDP and its own Adam optimizer). It may be smaller than
the policy: another checkpoint with the same tokenizer and/or its first ``num_layers`` decoder
layers. The last pipeline stage ends in the decoder's final norm and a scalar head
``Linear(H, 1)`` (replicated over TP, zero-initialised: p = 0.5 at the start) instead of the LM
head.
"""

from __future__ import annotations

import copy
import re

import torch

from nemo_sspo.megatron.hf_mapping import load_hf_into_megatron
from nemo_sspo.megatron.model import build_policy_model
from nemo_sspo.megatron.sequence_parallel import gather_sequence

__all__ = ["ValueModel", "build_value_model", "truncate_layers"]

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def truncate_layers(hf_config, state_dict: dict[str, torch.Tensor], num_layers: int):
    """The checkpoint's first ``num_layers`` decoder layers: ``(hf_config copy, state dict subset)``.

    Raises:
        ValueError: ``num_layers`` outside ``[1, num_hidden_layers]`` (names ``num_layers``).
    """
    total = hf_config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers} must be in [1, {total}] (the checkpoint's layers)")
    config = copy.deepcopy(hf_config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    kept = {key: value for key, value in state_dict.items()
            if not (m := _LAYER_KEY.match(key)) or int(m.group(1)) < num_layers}
    return config, kept


class ValueModel(torch.nn.Module):
    """A ``GPTModel`` stage whose last stage outputs one value per position instead of logits.

    The ``GPTModel`` is built with its LM head so that the HF mapping loads the final norm, then its
    last stage is made headless: Megatron's ``GPTModel.forward`` returns the decoder output (after
    the final norm) when ``post_process`` is False, and the output layer and, on every stage, the
    embedding tying (whose gradient all-reduce across stages would look for the output layer) are
    dropped. The scalar head
    ``value_head`` replaces them. The ``GPTModel`` is ``self.module``, so Megatron's
    ``get_attr_wrapped_model`` and this package's ``unwrap_model`` reach it through the wrapper.

    ``forward(input_ids, position_ids, attention_mask)`` returns values ``[B, S]`` (float, V(x) at
    every prefix) on the last stage and the stage's hidden states ``[S, B, H]`` elsewhere.
    """

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.module = gpt
        self.value_head = None
        # On every stage: with PP the first stage would otherwise all-reduce its embedding gradient
        # with the (removed) output layer of the last.
        gpt.share_embeddings_and_output_weights = False
        if gpt.post_process:
            gpt.post_process = False
            gpt.output_layer = None
            weight = next(gpt.parameters())
            self.value_head = torch.nn.Linear(gpt.config.hidden_size, 1, device=weight.device,
                                              dtype=gpt.config.params_dtype)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron distributed-checkpoint state (``nemo_sspo.trainer.checkpoint``): the GPTModel's
        own sharded state under ``module.``, and the value head (replicated over TP) under ``value_head.``.
        """
        from megatron.core.transformer.utils import sharded_state_dict_default

        state = self.module.sharded_state_dict(prefix=f"{prefix}module.", sharded_offsets=sharded_offsets,
                                               metadata=metadata)
        if self.value_head is not None:
            state.update(sharded_state_dict_default(self.value_head, f"{prefix}value_head.", sharded_offsets,
                                                    metadata))
        return state

    def forward(self, input_ids, position_ids, attention_mask):
        """This stage's output: hidden states off the last pipeline stage, else ``[B, S]`` value logits
        (the scalar head at every position). Under sequence parallelism the decoder's
        ``[S / tp, B, H]`` output is all-gathered over TP first
        (:func:`nemo_sspo.megatron.sequence_parallel.gather_sequence`; the head is replicated).
        """
        hidden = self.module(input_ids, position_ids, attention_mask)
        if self.value_head is None:
            return hidden
        hidden = gather_sequence(hidden, self.module.config)
        return self.value_head(hidden).squeeze(-1).transpose(0, 1)


def build_value_model(hf_config, state_dict: dict[str, torch.Tensor], *, num_layers: int | None = None,
                      **model_options) -> ValueModel:
    """This rank's critic stage (current parallel state), loaded from HF weights.

    Args:
        hf_config: the critic checkpoint's Llama / Qwen2 config (``load_hf_checkpoint``).
        state_dict: its HF weights (not modified).
        num_layers: keep the first N decoder layers (:func:`truncate_layers`); None keeps all.
        **model_options: ``precision``, ``fp8``, ``fp8_recipe``, ``transformer_impl``,
            ``sequence_parallel`` of ``build_policy_model`` (the policy's settings).
    """
    if num_layers is not None:
        hf_config, state_dict = truncate_layers(hf_config, state_dict, num_layers)
    gpt = build_policy_model(hf_config, **model_options)
    load_hf_into_megatron(gpt, state_dict, hf_config)
    return ValueModel(gpt)
