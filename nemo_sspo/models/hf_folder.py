"""Hugging Face model folders that every consumer loads (transformers, vLLM, ``load_hf_checkpoint``),
and the one stop-token list of a model.

Every model folder the product writes (the SmolLM2 cache, the folder a vLLM engine loads for a
built-in source, ``hf_checkpoint``, ``best/``, ``hf_checkpoint_interrupted``) is written by one
function, :func:`write_model_folder`, which takes the stop list as a required argument: a writer
that rebuilt it from the tokenizer alone would drop the ids only the source's generation config
declares (Llama-3: EOS 128001, generation config [128001, 128008, 128009]; a model reloaded from a
folder holding [128001] generates past ``<|eot_id|>``). The folders hold dense weights, so their
``config.json`` must not keep a source's ``quantization_config`` (the GGUF source leaves
``{quant_method: gguf}``, which vLLM refuses: "Unknown quantization method: gguf"), and must name
``architectures`` (vLLM picks its model class from it). ``generation_config.json`` carries the stop
list as ``eos_token_id``.

Stop list (:func:`stop_token_ids`): the tokenizer's EOS, every ``eos_token_id`` of the model folder's
``generation_config.json``, and ``<|im_end|>`` / ``<|endoftext|>`` when the vocabulary has them.
Qwen2.5 declares two end ids (``<|im_end|>`` 151645, ``<|endoftext|>`` 151643): a response that ends
with the one that is not the tokenizer's EOS must stop too, or it runs on into a made-up next turn.
The same list drives transformers ``generate``, vLLM's ``stop_token_ids``, the response mask and the
truncation flag of the rollout engines, and both evaluation engines.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, PretrainedConfig

__all__ = ["ADAPTER_DIR", "ARCHITECTURES", "PeftAdapter", "TIED_HEAD_KEY", "WEIGHTS_FILE", "clean_hf_config",
           "generation_eos_ids", "stop_token_ids", "write_model_folder"]

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
"""``model_type`` -> the ``architectures`` entry written to ``config.json``."""

# Chat and document ends of the Qwen2.5 / SmolLM2 vocabularies: base models often end a solution
# with <|endoftext|> rather than the tokenizer's EOS (<|im_end|>), so both stop generation.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")
_GENERATION_CONFIG = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
"""The single-file weights of every folder written here."""
TIED_HEAD_KEY = "lm_head.weight"
"""The output layer's name, left out of state dicts when the embeddings are tied."""
ADAPTER_DIR = "adapter"
"""Sub-folder of a model folder trained with LoRA: its adapters in the ``peft`` library's format."""
_PEFT_PREFIX = "base_model.model."  # peft's names: its wrapper's path to the transformers model


@dataclass(frozen=True)
class PeftAdapter:
    """LoRA adapters in the ``peft`` library's terms (``adapter_config.json`` fields), written beside the
    merged weights of a model folder as ``adapter/``.

    Attributes:
        tensors: ``model.layers.{l}.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]
            (HF module names, without peft's ``base_model.model.`` prefix).
        rank: ``r``.
        alpha: ``lora_alpha`` (the adapters' scale is ``alpha / r``).
        dropout: ``lora_dropout``.
        base_model: ``base_model_name_or_path``: the source the adapters were trained on.
    """

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float
    dropout: float
    base_model: str

    def write(self, folder: Path) -> None:
        """``folder/adapter_config.json`` and ``folder/adapter_model.safetensors`` (``folder`` is created).

        Mixture-of-experts adapters (``...mlp.experts.{e}.<proj>``) are written so that ``peft`` 0.21 can
        put them on transformers 5's fused 3-D expert parameters (measured here): ``lora_dropout`` 0
        (peft's wrapper of those parameters refuses any other value; dropout acts in training only),
        and an expert with gate/up adapters but none on ``down_proj`` gets zero ``down_proj`` factors
        (peft drops the gate/up adapters of a layer without them, silently; zero factors add nothing).
        """
        folder.mkdir()
        tensors = dict(self.tensors)
        for name, gate_a in self.tensors.items():
            if ".mlp.experts." in name and name.endswith(".gate_proj.lora_A.weight"):
                down = name.removesuffix(".gate_proj.lora_A.weight") + ".down_proj"
                if down + ".lora_A.weight" not in tensors:
                    gate_b = self.tensors[name.replace(".lora_A.", ".lora_B.")]
                    tensors[down + ".lora_A.weight"] = gate_a.new_zeros(self.rank, gate_b.shape[0])
                    tensors[down + ".lora_B.weight"] = gate_a.new_zeros(gate_a.shape[1], self.rank)
        experts = any(".mlp.experts." in name for name in tensors)
        targets = sorted({name.split(".")[-3] for name in tensors})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                  "lora_dropout": 0.0 if experts else self.dropout, "target_modules": targets, "bias": "none",
                  "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
                  "inference_mode": True, "base_model_name_or_path": self.base_model}
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        tensors = {_PEFT_PREFIX + name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def generation_eos_ids(model_dir: str | Path | None) -> list[int]:
    """The ``eos_token_id`` entries (int or list) of ``model_dir/generation_config.json``; ``[]`` when
    ``model_dir`` is None or has no such file.

    Raises:
        ValueError: the file is not valid JSON (names the file).
    """
    if model_dir is None or not (Path(model_dir) / _GENERATION_CONFIG).is_file():
        return []
    path = Path(model_dir) / _GENERATION_CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); fix or delete it") from err
    return _as_id_list(data.get("eos_token_id"))


def stop_token_ids(tokenizer, model_dir: str | Path | None = None) -> list[int]:
    """The model's stop list (module docstring), sorted, without duplicates.

    Args:
        tokenizer: its ``eos_token_id`` (if any) and vocabulary are read.
        model_dir: the model folder whose ``generation_config.json`` may declare more end ids (None:
            the tokenizer's ids only, e.g. for the built-in sources, which ship no generation config).

    Raises:
        ValueError: the list is empty (a tokenizer without EOS and no end tokens): set
            ``tokenizer.eos_token``.
    """
    ids = _as_id_list(tokenizer.eos_token_id) + generation_eos_ids(model_dir)
    vocab = tokenizer.get_vocab()
    ids += [vocab[token] for token in _END_TOKENS if token in vocab]
    if not ids:
        raise ValueError("the tokenizer has no EOS token and no <|im_end|>/<|endoftext|>: responses could never "
                         "stop; set tokenizer.eos_token")
    return sorted(set(ids))


def clean_hf_config(hf_config: PretrainedConfig, dtype: torch.dtype | None = None) -> PretrainedConfig:
    """A copy of ``hf_config`` for a folder of dense weights: without ``quantization_config``, with
    ``architectures`` set from ``model_type`` when missing, and ``dtype`` (the stored tensors')
    when given. ``hf_config`` itself is not changed.

    Raises:
        ValueError: ``architectures`` is missing and ``model_type`` is not one of :data:`ARCHITECTURES`.
    """
    config = copy.deepcopy(hf_config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    if not getattr(config, "architectures", None):
        if config.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {config.model_type!r} has no known architecture; "
                             f"supported: {', '.join(ARCHITECTURES)}")
        config.architectures = [ARCHITECTURES[config.model_type]]
    if dtype is not None:
        config.dtype = dtype
    return config


def _save_hf_config(hf_config: PretrainedConfig, folder: str | Path, *, stop_ids: list[int],
                   dtype: torch.dtype | None = None) -> None:
    """Writes ``config.json`` (:func:`clean_hf_config`) and ``generation_config.json`` (``eos_token_id``:
    ``stop_ids``, ``bos``/``pad`` from the config) into ``folder``, which must exist.

    Raises:
        ValueError: ``stop_ids`` is empty.
    """
    if not stop_ids:
        raise ValueError("stop_ids is empty; pass the model's stop list (stop_token_ids(tokenizer, model_dir))")
    config = clean_hf_config(hf_config, dtype)
    config.save_pretrained(folder)
    generation = GenerationConfig(bos_token_id=getattr(config, "bos_token_id", None),
                                  eos_token_id=list(stop_ids) if len(stop_ids) > 1 else stop_ids[0],
                                  pad_token_id=getattr(config, "pad_token_id", None))
    generation.save_pretrained(folder)


def write_model_folder(folder: str | Path, hf_config: PretrainedConfig, state_dict: dict[str, torch.Tensor],
                       tokenizer, *, stop_ids: list[int], extra: dict | None = None,
                       adapter: PeftAdapter | None = None) -> None:
    """Writes a complete Hugging Face model folder into the existing, empty ``folder``.

    The one writer of every model folder the product makes (module docstring); callers publish
    ``folder`` atomically.

    Args:
        folder: an existing empty directory (a temporary sibling of the final folder).
        hf_config: the model's config; written cleaned (:func:`clean_hf_config`) with the stored
            tensors' dtype.
        state_dict: HF names -> tensors on any device; ``lm_head.weight`` is dropped when the
            embeddings are tied (the convention of ``nemo_sspo.models``).
        tokenizer: saved with ``save_pretrained``.
        stop_ids: the model's stop list (:func:`stop_token_ids` of the source's tokenizer and folder),
            written as ``generation_config.json`` ``eos_token_id``; required, never rebuilt here.
        extra: ``name -> JSON-serialisable value``, each written as ``<name>.json``.
        adapter: LoRA: the adapters whose merge ``state_dict`` holds, written as ``folder/adapter``
            (loadable with ``peft.PeftModel.from_pretrained`` onto the base model); None: none.

    Raises:
        ValueError: ``stop_ids`` is empty, or ``hf_config`` names no known architecture.
    """
    folder = Path(folder)
    if adapter is not None:
        adapter.write(folder / ADAPTER_DIR)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    tensors = {name: value.detach().cpu().contiguous() for name, value in state_dict.items()
               if not (tied and name == TIED_HEAD_KEY)}
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
    _save_hf_config(hf_config, folder, stop_ids=stop_ids, dtype=dtype)
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    for key, value in (extra or {}).items():
        (folder / f"{key}.json").write_text(json.dumps(value, indent=1), encoding="utf-8")


def repair_config_file(folder: str | Path) -> bool:
    """Rewrites ``folder/config.json`` in place (atomically) if it still has a ``quantization_config`` or
    lacks ``architectures`` (caches written by earlier versions); returns whether it changed.
    """
    path = Path(folder) / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    if "quantization_config" not in data and data.get("architectures"):
        return False
    data.pop("quantization_config", None)
    if not data.get("architectures") and data.get("model_type") in ARCHITECTURES:
        data["architectures"] = [ARCHITECTURES[data["model_type"]]]
    fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return True
