"""Rollout generation with vLLM (the GPU engine), with weight refit from the trainer.

Same interface as :class:`nemo_sspo.rollout.HFRolloutEngine`: ``generate(prompts, *, seed) ->
RolloutBatch`` (with the engine's log-prob of each sampled token) and ``load_weights(hf_state_dict)``.
The in-loop evaluation wraps the engine's ``llm`` itself (``nemo_sspo.evaluation.as_eval_engine``). ``vllm`` is imported only when an engine is
built; without it a ``ValueError`` names the package and ``rollout.backend``.

vLLM's documented offline API only:

- ``vllm.LLM(model=..., tensor_parallel_size=..., dtype=..., gpu_memory_utilization=...,
  max_model_len=..., enforce_eager=..., seed=..., logprobs_mode="processed_logprobs",
  generation_config="vllm")``. ``processed_logprobs`` makes the returned log-probs those of the
  distribution actually sampled from (after temperature, and top-k/top-p if set): vLLM's default,
  ``raw_logprobs``, is the model's distribution before temperature, which is not what the trainer
  compares with (it divides its logits by ``rollout.temperature``). ``generation_config="vllm"``
  keeps a checkpoint's ``generation_config.json`` (e.g. ``repetition_penalty=1.05``, ``top_p=0.8``
  for Qwen instruct models) from changing the sampling distribution.
- ``vllm.SamplingParams(n=1, temperature, top_p, top_k, min_p=0, repetition_penalty=1,
  presence_penalty=0, frequency_penalty=0, max_tokens, seed, logprobs=0, stop_token_ids=[eos])``:
  every knob that reshapes the distribution is set explicitly to neutral; ``logprobs=0`` returns the
  sampled token's log-prob only. One request per row, seeded ``(seed + row) mod 2^63``.
- ``LLM.generate([{"prompt_token_ids": ids}, ...], [params, ...])``: prompts are tokenised here with
  the trainer's tokenizer (no special tokens added), so the trainer scores exactly these ids. Each
  ``RequestOutput.outputs[0]`` gives ``token_ids``, ``logprobs`` (one ``{token_id: Logprob}`` dict per
  generated token; ``Logprob.logprob`` is a float) and ``finish_reason`` (``"stop"`` or ``"length"``).
- Refit: ``LLM.apply_model(fn)`` runs ``fn(model)`` on the model inside each worker; ``fn`` calls the
  vLLM model's ``load_weights(iterable of (HF name, tensor))``, which maps HF names (q/k/v,
  gate/up stacking) itself. With vLLM's in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set
  by :meth:`VLLMRolloutEngine.build` unless already set) the tensors are passed by reference; with
  a multi-process engine (``rollout.vllm.tensor_parallel_size > 1``) vLLM serialises them through
  its RPC, which is slow for large models.

Sampling settings that bias the rollout away from the policy the trainer scores (``top_p < 1``,
``top_k > 0``) are refused unless the caller corrects for them (``truncation_corrected=True``: the
trainer sets it when ``rollout.tis_cap`` is set). Not run on these machines (no GPU, no vllm); the
parameter building and output conversion are tested with stand-in objects.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Sequence

import torch

from nemo_sspo.rollout.hf_engine import RolloutBatch, check_sampling_settings, encode_prompts, finish_rollout_batch

__all__ = ["VLLMRolloutEngine", "import_vllm", "rollout_batch_from_outputs", "vllm_sampling_kwargs"]

_FINISH_REASONS = ("stop", "length")


def import_vllm():
    """The ``vllm`` module.

    Raises:
        ValueError: vllm is not installed (names ``rollout.backend``).
    """
    try:
        import vllm
    except ImportError as err:
        raise ValueError("rollout.backend='vllm' needs the package vllm (GPU only), which is not installed: "
                         "pip install vllm in a CUDA environment, or set rollout.backend=hf") from err
    return vllm


def vllm_sampling_kwargs(*, max_new_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                         seed: int, eos_token_id: int, truncation_corrected: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one training rollout (module docstring).

    Raises:
        ValueError: a setting out of range, or ``top_p < 1`` / ``top_k > 0`` without
            ``truncation_corrected`` (they sample from a renormalised subset of the vocabulary, so the
            rollout is off-policy for the trainer: docs/pitfalls.md#p14; names ``rollout.top_p`` and the fix).
    """
    check_sampling_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    if (top_p < 1.0 or top_k > 0) and not truncation_corrected:
        raise ValueError(f"rollout.top_p={top_p} / top_k={top_k} with rollout.backend=vllm samples from a truncated "
                         "distribution the trainer does not score (docs/pitfalls.md#p14); use rollout.top_p=1.0, or set "
                         "rollout.tis_cap to correct it by importance sampling")
    return dict(n=1, temperature=float(temperature), top_p=float(top_p), top_k=top_k if top_k > 0 else -1,
                min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                max_tokens=max_new_tokens, seed=seed, logprobs=0, stop_token_ids=[eos_token_id])


def _row_seed(seed: int, row: int) -> int:
    return (seed + row) % 2**63


def _completion_tensors(completion) -> tuple[list[int], list[float], bool]:
    """``(token ids, sampled-token log-probs, truncated)`` of one vLLM ``CompletionOutput``."""
    token_ids = list(completion.token_ids)
    if completion.logprobs is None:
        raise ValueError("vLLM returned no log-probs: the request needs SamplingParams(logprobs=0)")
    if len(completion.logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned {len(completion.logprobs)} log-prob entries for {len(token_ids)} tokens")
    if completion.finish_reason not in _FINISH_REASONS:
        raise ValueError(f"vLLM request finished with {completion.finish_reason!r}; expected one of {_FINISH_REASONS}")
    logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, token_ids)]
    return token_ids, logprobs, completion.finish_reason == "length"


def rollout_batch_from_outputs(outputs: Sequence[Any], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                               tokenizer) -> RolloutBatch:
    """Converts vLLM ``RequestOutput`` objects (one per row, in row order) into a :class:`RolloutBatch`.

    Args:
        outputs: ``B`` objects with ``.outputs[0]`` carrying ``token_ids``, ``logprobs`` and
            ``finish_reason`` (module docstring).
        prompt_ids, prompt_mask: ``[B, P]`` the LEFT-padded prompts the requests were built from.
        tokenizer: for the pad id and the texts.

    Returns:
        responses RIGHT-padded to the longest (at least 1 column); a row is truncated when vLLM
        stopped it at ``max_tokens`` (``finish_reason == "length"``).

    Raises:
        ValueError: a count mismatch, missing log-probs, or an aborted request.
    """
    if len(outputs) != prompt_ids.shape[0]:
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {prompt_ids.shape[0]} prompts")
    rows = [_completion_tensors(out.outputs[0]) for out in outputs]
    width = max([len(ids) for ids, _, _ in rows] + [1])
    response_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(rows), width, dtype=torch.float32)
    response_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, (ids, lps, _) in enumerate(rows):
        response_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        logprobs[b, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        response_mask[b, : len(ids)] = True
    truncated = torch.tensor([trunc for _, _, trunc in rows], dtype=torch.bool)
    return finish_rollout_batch(tokenizer, prompt_ids, prompt_mask, response_ids, response_mask, truncated, logprobs)


def _load_weights_into(weights: list[tuple[str, torch.Tensor]], model) -> None:
    """Runs inside a vLLM worker (``LLM.apply_model``): the model maps HF names itself."""
    model.load_weights(weights)


class VLLMRolloutEngine:
    """Sampling with a ``vllm.LLM`` (module docstring); construct with :meth:`build`.

    Args:
        llm: a ``vllm.LLM`` built with ``logprobs_mode="processed_logprobs"``.
        tokenizer: the trainer's tokenizer (pad and EOS ids required).
        max_new_tokens, temperature, top_p, top_k: as :class:`HFRolloutEngine`.
        truncation_corrected: allow ``top_p < 1`` / ``top_k > 0`` (the caller applies TIS).

    Raises:
        ValueError: see :func:`vllm_sampling_kwargs`; a tokenizer without pad/EOS ids.
    """

    def __init__(self, llm, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float = 1.0,
                 top_k: int = 0, truncation_corrected: bool = False) -> None:
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("tokenizer needs pad_token_id and eos_token_id; set pad_token = eos_token")
        self._sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              eos_token_id=tokenizer.eos_token_id, truncation_corrected=truncation_corrected)
        vllm_sampling_kwargs(seed=0, **self._sampling)  # validate now, not at the first step
        self.llm, self.tokenizer = llm, tokenizer

    @classmethod
    def build(cls, model_dir: str, tokenizer, *, vllm_config, seed: int, **sampling) -> "VLLMRolloutEngine":
        """A new engine for the HF model directory ``model_dir`` (its initial weights).

        Args:
            vllm_config: the ``rollout.vllm`` section (``tensor_parallel_size``,
                ``gpu_memory_utilization``, ``dtype``, ``max_model_len``, ``enforce_eager``).
            seed: engine seed (``trainer.seed``).
            **sampling: the constructor's sampling arguments.
        """
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = import_vllm()
        llm = vllm.LLM(model=str(model_dir), tensor_parallel_size=vllm_config.tensor_parallel_size,
                       dtype=vllm_config.dtype, gpu_memory_utilization=vllm_config.gpu_memory_utilization,
                       max_model_len=vllm_config.max_model_len, enforce_eager=vllm_config.enforce_eager, seed=seed,
                       logprobs_mode="processed_logprobs", generation_config="vllm")
        return cls(llm, tokenizer, **sampling)

    def generate(self, prompts: list[str], *, seed: int) -> RolloutBatch:
        """One sampled response per prompt (repeat a prompt G times for a group); see
        :meth:`HFRolloutEngine.generate`. Row ``b`` is seeded ``(seed + b) mod 2^63``."""
        vllm = import_vllm()
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts)
        requests = [{"prompt_token_ids": ids[mask].tolist()} for ids, mask in zip(prompt_ids, prompt_mask)]
        params = [vllm.SamplingParams(**vllm_sampling_kwargs(seed=_row_seed(seed, b), **self._sampling))
                  for b in range(len(requests))]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return rollout_batch_from_outputs(outputs, prompt_ids, prompt_mask, self.tokenizer)

    def load_weights(self, hf_state_dict: dict[str, torch.Tensor]) -> None:
        """Refit: loads ``hf_state_dict`` (HF names, as ``export_hf_state_dict`` returns) into vLLM's model."""
        self.llm.apply_model(partial(_load_weights_into, list(hf_state_dict.items())))
