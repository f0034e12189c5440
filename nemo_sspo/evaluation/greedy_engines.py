"""Greedy generation engines for evaluation: transformers on CPU, vLLM (CPU or GPU; imported lazily).

Both implement :class:`EvalEngine`: ``generate_greedy(prompts, max_new_tokens) -> list[str]``,
rendered prompts in, decoded responses (special tokens removed) out, one per prompt, in order. Both
stop at the model's stop list (:func:`nemo_sspo.models.hf_folder.stop_token_ids`), the same list the
rollout engines stop at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from transformers import GenerationConfig

from nemo_sspo.models.hf_folder import stop_token_ids

_model_stop_ids = stop_token_ids  # the constructors' argument of the same name shadows it

__all__ = ["EvalEngine", "TransformersEvalEngine", "VLLMEvalEngine", "stop_token_ids"]


class EvalEngine(Protocol):
    """A greedy decoder for evaluation: rendered prompts in, decoded responses out."""
    def generate_greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        """One greedy (temperature 0) response per rendered prompt, decoded without special tokens."""
        ...


class TransformersEvalEngine:
    """Batched greedy decoding with a ``transformers`` causal LM (the CPU backend).

    Args:
        model: a ``PreTrainedModel`` (e.g. from ``nemo_sspo.models.build_hf_model``); it is put
            in eval mode and run without gradients.
        tokenizer: its tokenizer; needs a pad token (``load_hf_checkpoint`` sets one).
        batch_size: prompts per ``generate`` call (>= 1); prompts are left-padded within a batch.
        stop_token_ids: the stop list (default: :func:`stop_token_ids` of ``tokenizer``).

    Raises:
        ValueError: ``batch_size < 1`` or a tokenizer without a pad token.
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 8, stop_token_ids: Sequence[int] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token: set tokenizer.pad_token = tokenizer.eos_token")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.stop_token_ids = sorted(stop_token_ids) if stop_token_ids is not None else _model_stop_ids(tokenizer)

    @torch.no_grad()
    def generate_greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        """One greedy response per prompt, in batches of ``batch_size`` (special tokens removed)."""
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                  pad_token_id=self.tokenizer.pad_token_id,
                                  eos_token_id=list(self.stop_token_ids))
        texts: list[str] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = list(prompts[start:start + self.batch_size])
            enc = self.tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left",
                                 add_special_tokens=False)
            out = self.model.generate(input_ids=enc["input_ids"].to(self.model.device),
                                      attention_mask=enc["attention_mask"].to(self.model.device),
                                      generation_config=config)
            texts += self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return texts


class VLLMEvalEngine:
    """Greedy decoding with vLLM's offline ``LLM`` API.

    ``vllm.SamplingParams(temperature=0.0, max_tokens=..., stop_token_ids=<stop list>)`` and
    ``LLM.generate(prompts, sampling_params)``, whose results carry ``.outputs[0].text``. A new engine
    is built by :func:`nemo_sspo.rollout.vllm_engine.build_llm` (no side effects on this process's RNGs
    or threads; KV cache from ``cpu_kv_cache_gib`` on CPU).

    Args:
        model: a model directory / hub id (a new engine is built), or an existing ``vllm.LLM``
            (e.g. the trainer's refitted rollout engine), used as is.
        stop_token_ids: the stop list (default: :func:`stop_token_ids` of the engine's tokenizer and,
            for a directory, its ``generation_config.json``).
        seed: engine seed (greedy decoding does not depend on it).
        **settings: the ``rollout.engine.options`` settings (``tensor_parallel_size``, ``gpu_memory_utilization``,
            ``dtype``, ``max_model_len``, ``enforce_eager``, ``cpu_kv_cache_gib``, ``enable_sleep_mode``),
            passed to ``build_llm`` when one is built.

    Raises:
        ValueError: the package ``vllm`` is not installed (names ``rollout.engine.backend``).
    """

    def __init__(self, model: Any, *, stop_token_ids: Sequence[int] | None = None, seed: int = 0,
                 **settings) -> None:
        from nemo_sspo.rollout.vllm_engine import build_llm, import_vllm, preserve_process_state

        self._vllm = import_vllm()
        self._preserve = preserve_process_state
        model_dir = None
        if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            model_dir = Path(str(model))
            model = build_llm(model_dir, seed=seed, logprobs_mode=None, **settings)
        self.llm = model
        if stop_token_ids is None:
            stop_token_ids = _model_stop_ids(model.get_tokenizer(),
                                                         model_dir if model_dir is not None and model_dir.is_dir() else None)
        self.stop_token_ids = sorted(stop_token_ids)

    def generate_greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        """One greedy response per prompt from the vLLM engine (special tokens removed)."""
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens,
                                           stop_token_ids=list(self.stop_token_ids))
        with self._preserve():
            outputs = self.llm.generate(list(prompts), params, use_tqdm=False)
        return [output.outputs[0].text for output in outputs]
