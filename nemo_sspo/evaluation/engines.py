"""Greedy generation engines for evaluation: transformers on CPU, vLLM on GPU (imported lazily).

Both implement :class:`EvalEngine`: ``generate_greedy(prompts, max_new_tokens) -> list[str]``,
rendered prompts in, decoded responses (special tokens removed) out, one per prompt, in order.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from transformers import GenerationConfig

__all__ = ["EvalEngine", "TransformersEvalEngine", "VLLMEvalEngine", "stop_token_ids"]

# Chat and document ends of the Qwen2.5 / SmolLM2 vocabularies: base models often end a solution
# with <|endoftext|> rather than the tokenizer's EOS (<|im_end|>), so both stop generation.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


class EvalEngine(Protocol):
    def generate_greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        """One greedy (temperature 0) response per rendered prompt, decoded without special tokens."""
        ...


def stop_token_ids(tokenizer) -> list[int]:
    """The tokenizer's EOS id plus the ids of ``<|im_end|>`` / ``<|endoftext|>`` when it has them."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    vocab = tokenizer.get_vocab()
    ids += [vocab[token] for token in _STOP_TOKENS if token in vocab]
    return sorted(set(ids))


class TransformersEvalEngine:
    """Batched greedy decoding with a ``transformers`` causal LM (the CPU backend).

    Args:
        model: a ``PreTrainedModel`` (e.g. from ``nemo_sspo.models.build_hf_model``); it is put
            in eval mode and run without gradients.
        tokenizer: its tokenizer; needs a pad token (``load_hf_checkpoint`` sets one).
        batch_size: prompts per ``generate`` call (>= 1); prompts are left-padded within a batch.

    Raises:
        ValueError: ``batch_size < 1`` or a tokenizer without a pad token.
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 8) -> None:
        if batch_size < 1:
            raise ValueError(f"eval.batch_size={batch_size} must be >= 1")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token: set tokenizer.pad_token = tokenizer.eos_token")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size

    @torch.no_grad()
    def generate_greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                  pad_token_id=self.tokenizer.pad_token_id,
                                  eos_token_id=stop_token_ids(self.tokenizer))
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
    """Greedy decoding with vLLM's offline ``LLM`` API (the GPU backend).

    Uses only vLLM's documented entry points: ``vllm.LLM(model=..., tensor_parallel_size=...,
    dtype=..., gpu_memory_utilization=..., max_model_len=..., enforce_eager=..., seed=...)``,
    ``vllm.SamplingParams(temperature=0.0, max_tokens=...)`` and
    ``LLM.generate(prompts, sampling_params)`` whose results carry ``.outputs[0].text``.

    Args:
        model: a model directory / hub id (a new engine is built), or an existing ``vllm.LLM``
            (e.g. the trainer's refitted rollout engine), used as is.
        tensor_parallel_size, gpu_memory_utilization, dtype, max_model_len, enforce_eager: the
            ``rollout.vllm`` settings, passed to ``vllm.LLM`` when one is built.
        seed: engine seed (greedy decoding does not depend on it).

    Raises:
        ValueError: the package ``vllm`` is not installed (names ``rollout.backend``).
    """

    def __init__(self, model: Any, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 dtype: str = "bfloat16", max_model_len: int | None = None, enforce_eager: bool = False,
                 seed: int = 0) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ValueError(
                "rollout.backend='vllm' needs the package vllm (GPU only), which is not installed: "
                "pip install vllm in a CUDA environment, or set rollout.backend=hf"
            ) from err
        self._vllm = vllm
        if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            model = vllm.LLM(model=str(model), tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                             gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                             enforce_eager=enforce_eager, seed=seed)
        self.llm = model

    def generate_greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        outputs = self.llm.generate(list(prompts), params)
        return [output.outputs[0].text for output in outputs]
