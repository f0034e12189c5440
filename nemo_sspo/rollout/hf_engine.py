"""Rollout generation with transformers ``generate`` (the CPU engine) and in-place weight refit."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from nemo_sspo.algorithms.batch import pack_rows, pad_cat, route_dtype
from nemo_sspo.models.hf_checkpoint import check_state_dict_keys
from nemo_sspo.models.hf_folder import stop_token_ids as model_stop_token_ids
from nemo_sspo.models.moe_weights import fuse_expert_weights, split_expert_weights
from nemo_sspo.parallel.fused_output import OutputPrecision, output_matmul_dtype, tf32_matmuls

__all__ = ["PAD_ID", "HFRolloutEngine", "RolloutBatch", "check_engine_outputs", "check_sampling_settings", "encode_prompts",
           "finish_rollout_batch"]


PAD_ID = "pad_id"
"""A :class:`RolloutBatch` field's ``fill``: the tokenizer's pad id (given where batches are stacked)."""


@dataclass
class RolloutBatch:
    """One batch of sampled responses, row ``b`` answering ``prompts[b]``.

    Attributes:
        prompt_ids: ``[B, P]`` int64, LEFT-padded with the pad id.
        prompt_mask: ``[B, P]`` bool, True on real prompt tokens.
        response_ids: ``[B, T]`` int64, RIGHT-padded with the pad id; ``T`` is the longest response
            of the batch (at most ``max_new_tokens``).
        response_mask: ``[B, T]`` bool, True on generated tokens up to and including the first stop id
            (the model's stop list: ``nemo_sspo.models.hf_folder.stop_token_ids``).
        truncated: ``[B]`` bool, True when no stop id was produced within ``max_new_tokens``.
        response_texts: the responses decoded without special tokens.
        rollout_logprobs: ``[B, T]`` float32, natural-log probability of each sampled token under
            the sampling distribution (after temperature / top-k / top-p); 0 where the mask is False.
        routes: ``[B, S, L_all, k]`` int16 (int32 past 32768 experts:
            :func:`nemo_sspo.algorithms.batch.route_dtype`), the k experts the engine's router
            chose for each input token in each of the model's L_all MoE layers, in the trainer's packed input frame: row
            ``b`` holds its prompt tokens then its response tokens at ``0 .. P_b + T_b - 1`` (0
            after them), ``S = max(P_b + T_b)``. Only with router replay R3 on an engine that
            records them (``HFRolloutEngine(record_routes=True)``); None otherwise.
        token_versions: ``[B, T]`` int64, the policy version (updates behind the weights) that
            sampled each response token, where a response was continued across a refit (partial
            rollouts, :mod:`nemo_sspo.rollout.partial`); -1 off the mask. None: one version sampled
            the whole batch.

    Each field's metadata says how rows of several batches stack and how a subset of rows is cut
    (``nemo_sspo.rollouts.slots``): ``frame`` is ``row`` (one entry per row), ``prompt`` (columns of
    the left-padded prompt), ``response`` (columns of the right-padded response) or ``packed`` (the
    packed input frame, right-padded); ``fill`` is the padding value, :data:`PAD_ID` for the
    tokenizer's pad id. A new field declares its own, and stacking, cutting and the transports
    (``nemo_sspo.rollouts.codec``) carry it with no other edit.
    """

    prompt_ids: torch.Tensor = field(metadata={"frame": "prompt", "fill": PAD_ID})
    prompt_mask: torch.Tensor = field(metadata={"frame": "prompt", "fill": False})
    response_ids: torch.Tensor = field(metadata={"frame": "response", "fill": PAD_ID})
    response_mask: torch.Tensor = field(metadata={"frame": "response", "fill": False})
    truncated: torch.Tensor = field(metadata={"frame": "row"})
    response_texts: list[str] = field(metadata={"frame": "row"})
    rollout_logprobs: torch.Tensor = field(metadata={"frame": "response", "fill": 0.0})
    routes: torch.Tensor | None = field(default=None, metadata={"frame": "packed", "fill": 0})
    token_versions: torch.Tensor | None = field(default=None, metadata={"frame": "response", "fill": -1})


class _Interrupt(StoppingCriteria):
    """Stops every row of a ``generate`` once ``interrupt()`` returns True (polled after each decode step)."""

    def __init__(self, interrupt: Callable[[], bool]) -> None:
        self.interrupt = interrupt

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), bool(self.interrupt()), dtype=torch.bool, device=input_ids.device)


def check_sampling_settings(*, max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    """Range checks shared by the rollout engines.

    Raises:
        ValueError: ``max_new_tokens <= 0``, ``temperature <= 0``, ``top_p`` outside (0, 1] or ``top_k < 0``.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be > 0")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (sampling only; no greedy mode here)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]; use 1.0 for training (docs/pitfalls.md#p14)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 disables it)")


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_ids [B, P] int64 LEFT-padded, prompt_mask [B, P] bool)``; no special tokens added.

    Raises:
        ValueError: ``prompts`` is empty.
    """
    if not prompts:
        raise ValueError("prompts is empty; pass at least one rendered prompt")
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"].bool()


def _first(bad: torch.Tensor) -> tuple[int, int] | None:
    """``(row, position)`` of the first True entry of a ``[B, T]`` bool tensor in row-major order, or None."""
    hits = torch.nonzero(bad)
    return None if hits.numel() == 0 else (int(hits[0, 0]), int(hits[0, 1]))


def check_engine_outputs(response_ids: torch.Tensor, response_mask: torch.Tensor, logprobs: torch.Tensor, *,
                         engine: str, vocab_size: int, max_new_tokens: int) -> None:
    """Refuses what a rollout engine returned unless every response token is usable by the trainer.

    The one check at the engine boundary (both engines' results pass :func:`finish_rollout_batch`):
    a NaN or positive log-prob would otherwise reach the TIS weights, the loss and the gap metric,
    and an id outside the model's vocabulary would index past its embedding rows.

    Args:
        response_ids: ``[B, T]`` int64 sampled ids.
        response_mask: ``[B, T]`` bool, True on the response tokens (only these are checked).
        logprobs: ``[B, T]`` float, natural-log probability of each sampled token.
        engine: the engine's name for the message (``rollout.engine.backend``: "hf" or "vllm").
        vocab_size: rows of the model's embedding (may exceed the tokenizer's ids, e.g. Qwen2.5).
        max_new_tokens: the response length cap (``rollout.sampling.max_new_tokens``).

    Raises:
        ValueError: a log-prob that is not finite or is > 0, an id outside ``[0, vocab_size)``, or a
            response longer than ``max_new_tokens``; names the engine, the row and the token position.
    """
    where = f"rollout engine {engine!r}"
    lengths = response_mask.sum(dim=1)
    too_long = torch.nonzero(lengths > max_new_tokens).flatten()
    if too_long.numel():
        row = int(too_long[0])
        raise ValueError(f"{where} returned {int(lengths[row])} tokens for row {row}, more than "
                         f"max_new_tokens={max_new_tokens}; the engine ignored its length cap")
    bad = _first(response_mask & ((response_ids < 0) | (response_ids >= vocab_size)))
    if bad is not None:
        raise ValueError(f"{where} returned token id {int(response_ids[bad])} at row {bad[0]}, response position "
                         f"{bad[1]}: outside the model's vocabulary [0, {vocab_size}); the engine must load the "
                         "trainer's model (same config.json)")
    lp = logprobs.float()
    # ~(lp <= 0) is True for NaN as well as for positive values and +inf; -inf is caught by isfinite.
    bad = _first(response_mask & (~(lp <= 0) | ~torch.isfinite(lp)))
    if bad is not None:
        raise ValueError(f"{where} returned log-prob {float(lp[bad])} for token id {int(response_ids[bad])} at row "
                         f"{bad[0]}, response position {bad[1]}: a sampled token's log-prob must be finite and <= 0 "
                         "(a NaN or inf usually means the engine's logits overflowed: try a wider rollout dtype)")


def finish_rollout_batch(tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                         response_mask: torch.Tensor, truncated: torch.Tensor, logprobs: torch.Tensor, *,
                         engine: str, vocab_size: int, max_new_tokens: int,
                         routes: torch.Tensor | None = None) -> RolloutBatch:
    """A :class:`RolloutBatch` from an engine's CPU tensors, checked first (:func:`check_engine_outputs`).

    Writes the pad id and log-prob 0 outside ``response_mask`` (``response_ids`` is modified in place)
    and decodes the texts.

    Args:
        tokenizer: for the pad id and the texts.
        prompt_ids: ``[B, P]`` int64, the LEFT-padded prompts.
        prompt_mask: ``[B, P]`` bool, True on real prompt tokens.
        response_ids: ``[B, T]`` int64 sampled ids (any values outside the mask).
        response_mask: ``[B, T]`` bool, True up to and including the first stop id.
        truncated: ``[B]`` bool, no stop id within the cap.
        logprobs: ``[B, T]`` float, the sampled tokens' log-probs (any values outside the mask).
        engine: as :func:`check_engine_outputs`.
        vocab_size: as :func:`check_engine_outputs`.
        max_new_tokens: as :func:`check_engine_outputs`.
        routes: the engine's routes (:attr:`RolloutBatch.routes`), or None.

    Returns:
        the batch.

    Raises:
        ValueError: see :func:`check_engine_outputs`.
    """
    check_engine_outputs(response_ids, response_mask, logprobs, engine=engine, vocab_size=vocab_size,
                         max_new_tokens=max_new_tokens)
    response_ids[~response_mask] = tokenizer.pad_token_id
    # where, not multiply: a filtered (top-k/top-p) pad position has log-prob -inf and -inf * 0 = NaN.
    logprobs = torch.where(response_mask, logprobs.float(), 0.0)
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, truncated=truncated, response_texts=texts,
                        rollout_logprobs=logprobs, routes=routes)


def _check_bucket(bucket: dict[str, torch.Tensor], params: dict[str, torch.Tensor], seen: set[str]) -> None:
    """Refuses a refit bucket with names the model lacks, names an earlier bucket set, or wrong shapes."""
    unknown, repeated = sorted(bucket.keys() - params.keys()), sorted(bucket.keys() & seen)
    if unknown or repeated:
        raise ValueError(f"refit bucket: unknown keys {unknown[:5]}, keys already loaded by an earlier bucket "
                         f"{repeated[:5]} (use HF Llama/Qwen2 names, each in exactly one bucket)")
    for name, value in bucket.items():
        if params[name].shape != value.shape:
            raise ValueError(f"hf_state_dict[{name!r}] has shape {tuple(value.shape)}, "
                             f"expected {tuple(params[name].shape)}")


class HFRolloutEngine:
    """Batched sampling from a ``transformers`` causal LM, with weight refit from the trainer.

    Args:
        model: a ``PreTrainedModel`` (e.g. from ``build_hf_model``); used in eval mode, no grad.
        tokenizer: its tokenizer; must define ``pad_token_id``.
        stop_token_ids: the ids that end a response (default: ``nemo_sspo.models.hf_folder.stop_token_ids(tokenizer)``;
            the trainer passes the model folder's list); they drive ``generate``, the response mask and
            the truncation flag.
        max_new_tokens: response length cap ``T_max`` (tokens), > 0.
        temperature: > 0; the sampling logits are ``logits / temperature``.
        top_p: nucleus mass in (0, 1]. Keep 1.0 for training (docs/pitfalls.md#p14): with ``top_p < 1`` the
            rollout log-probs are renormalised over the kept support, so the gap between rollout and
            trainer (full-vocabulary) log-probs grows and the first-step ratio is no longer 1.
        top_k: keep the ``top_k`` most likely tokens, 0 = off; same docs/pitfalls.md#p14 caveat as ``top_p``.
        device: where to generate (the model is moved there; e.g. the trainer's CUDA device); None
            keeps the model where it is. Returned tensors are always on the CPU.
        record_routes: record the experts every MoE layer chose for every token it ran
            (:attr:`RolloutBatch.routes`, router replay R3; :meth:`_routes`); needs a Qwen3-MoE model.
        output_layer_precision: the output layer's matmul precision (``model.output_layer_precision``, as the
            trainer's fused path: ``nemo_sspo.parallel.fused_output``): ``auto`` leaves the model as
            it is; otherwise the final hidden states and the head weight are cast to that dtype for
            the logits (the cast weight kept until the next refit: one extra ``[V, H]`` tensor).

    Memory: ``generate`` keeps the processed scores of every step, ``B * T * V`` fp32 values
    (32 x 160 x 49152 x 4 B = 1.0 GB for SmolLM2), until :meth:`generate` returns.

    Raises:
        ValueError: a sampling setting out of range, a tokenizer without pad/EOS ids,
            ``record_routes`` for a model without Qwen3-MoE layers, or an unknown ``output_layer_precision``.
    """

    def __init__(self, model, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float = 1.0,
                 top_k: int = 0, device: torch.device | str | None = None,
                 stop_token_ids: list[int] | None = None, record_routes: bool = False,
                 output_layer_precision: str = "auto") -> None:
        check_sampling_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        if output_layer_precision not in tuple(OutputPrecision):
            raise ValueError(f"output_layer_precision={output_layer_precision!r} must be one of "
                             f"{', '.join(OutputPrecision)}")
        self.routers = [block.gate for block in model.modules() if isinstance(block, Qwen3MoeSparseMoeBlock)]
        if record_routes and not self.routers:
            raise ValueError("record_routes=True needs a mixture-of-experts model (Qwen3MoeSparseMoeBlock "
                             f"layers); {type(model).__name__} has none")
        self.record_routes = record_routes
        # Every decode step's top-k is kept until generate returns: keep it in the small dtype.
        self.route_dtype = route_dtype(self.routers[0].num_experts) if self.routers else None
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer needs pad_token_id; set pad_token = eos_token")
        if stop_token_ids is None:
            stop_token_ids = model_stop_token_ids(tokenizer)
        if not stop_token_ids:
            raise ValueError("stop_token_ids is empty; pass the model's stop list")
        self.stop_token_ids = sorted(set(int(i) for i in stop_token_ids))
        self.model = (model if device is None else model.to(device)).eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        # A complete config, so nothing is inherited from the checkpoint's generation defaults.
        self._generation_config = GenerationConfig(
            do_sample=True,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=list(self.stop_token_ids),
            output_scores=True,
            return_dict_in_generate=True,
        )
        self._head_weight: torch.Tensor | None = None  # the head weight in the output precision, until a refit
        if output_layer_precision != "auto":
            self._set_output_precision(output_layer_precision)

    def _set_output_precision(self, precision: str) -> None:
        """Replaces the head's forward by ``hidden.to(dtype) @ W.to(dtype)^T`` (+ bias) in the dtype of
        ``precision`` (TF32 products on CUDA for ``tf32``); the module and its parameters stay as they
        are, so state dicts, tying and refit are unchanged.
        """
        head = self.model.get_output_embeddings()
        dtype = output_matmul_dtype(precision, head.weight.dtype)

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            if self._head_weight is None:
                self._head_weight = head.weight.detach().to(dtype)
            bias = None if head.bias is None else head.bias.detach().to(dtype)
            with tf32_matmuls(precision == "tf32", hidden.device):
                return torch.nn.functional.linear(hidden.to(dtype), self._head_weight, bias)

        head.forward = forward

    @torch.no_grad()
    def generate(self, prompts: list[str], *, seed: int) -> RolloutBatch:
        """Sample one response per prompt (repeat a prompt G times for a group).

        Args:
            prompts: already rendered prompts (chat template applied); no special tokens are added.
            seed: sampling seed; the same seed, prompts and weights give the same responses. The
                global torch RNG is left as it was.

        Returns:
            a :class:`RolloutBatch` with ``B = len(prompts)``.

        Raises:
            ValueError: a non-finite or positive log-prob (e.g. fp16 logits that overflowed), an id
                outside the vocabulary or an over-long response (:func:`check_engine_outputs`).
        """
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts)
        forwards: list[list[torch.Tensor]] = []
        with self._recording(forwards, len(prompts)):
            response_ids, logprobs = self._sample(prompt_ids, prompt_mask, seed, self._generation_config)
        response_mask, truncated = self._response_mask(response_ids)
        routes = self._routes(forwards, prompt_mask, response_mask) if self.record_routes else None
        return finish_rollout_batch(self.tokenizer, prompt_ids, prompt_mask, response_ids, response_mask, truncated,
                                    logprobs, engine="hf", vocab_size=self.model.config.vocab_size,
                                    max_new_tokens=self.max_new_tokens, routes=routes)

    @torch.no_grad()
    def generate_partial(self, prompts: list[str], prefixes: list[torch.Tensor], *, seed: int,
                         interrupt: Callable[[], bool] | None = None) -> RolloutBatch:
        """Continues each prompt's response after the tokens already sampled (partial rollouts,
        :mod:`nemo_sspo.rollout.partial`), stopping early when ``interrupt`` says so.

        Row ``b`` is fed ``prompts[b]`` followed by ``prefixes[b]`` and samples at most
        ``max_new_tokens - len(prefixes[b])`` more tokens, until a stop id. With empty prefixes and
        no interruption it samples exactly what :meth:`generate` does with the same seed.

        Args:
            prompts: rendered prompts, as :meth:`generate`.
            prefixes: ``[n_b]`` int64 response tokens row ``b`` already has, ``n_b < max_new_tokens``.
            seed: sampling seed (the global torch RNG is left as it was).
            interrupt: polled after every decode step; when it returns True every row stops there
                (a row then ends without a stop id below its budget: it is unfinished).

        Returns:
            A :class:`RolloutBatch` of the new tokens only (``response_*`` and ``rollout_logprobs``
            ``[B, T']``; ``truncated``: no stop id among them), the prompts as :meth:`generate` pads them.

        Raises:
            ValueError: a prefix as long as ``max_new_tokens`` or longer, ``record_routes`` (routes of
                a continued response are not recorded), or as :meth:`generate`.
        """
        lengths = torch.tensor([len(prefix) for prefix in prefixes], dtype=torch.int64)
        if len(prefixes) != len(prompts) or bool((lengths >= self.max_new_tokens).any()):
            raise ValueError(f"generate_partial needs one prefix per prompt, each shorter than max_new_tokens="
                             f"{self.max_new_tokens}; got lengths {lengths.tolist()} for {len(prompts)} prompts")
        if self.record_routes:
            raise ValueError("generate_partial does not record routes (router replay R3 needs whole responses)")
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts)
        fed = [torch.cat([ids[mask], prefix.to(ids.dtype)]) for ids, mask, prefix in zip(prompt_ids, prompt_mask,
                                                                                         prefixes, strict=True)]
        input_ids = pad_cat([row[None] for row in fed], self.tokenizer.pad_token_id, left=True)
        input_mask = pad_cat([torch.ones(1, len(row), dtype=torch.bool) for row in fed], False, left=True)
        remaining = self.max_new_tokens - lengths
        config = copy.deepcopy(self._generation_config)
        config.max_new_tokens = int(remaining.max())
        stopping = StoppingCriteriaList([_Interrupt(interrupt)] if interrupt is not None else [])
        response_ids, logprobs = self._sample(input_ids, input_mask, seed, config, stopping)
        response_mask, truncated = self._response_mask(response_ids)
        response_mask &= torch.arange(response_ids.shape[1])[None] < remaining[:, None]  # each row's own budget
        return finish_rollout_batch(self.tokenizer, prompt_ids, prompt_mask, response_ids, response_mask, truncated,
                                    logprobs, engine="hf", vocab_size=self.model.config.vocab_size,
                                    max_new_tokens=config.max_new_tokens)

    def _sample(self, input_ids: torch.Tensor, input_mask: torch.Tensor, seed: int, config: GenerationConfig,
                stopping: StoppingCriteriaList | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(new ids [B, T] int64, their log-probs [B, T] float32)`` on the CPU, sampled with ``seed``."""
        device = self.model.device
        # Fork (and so restore) the generator that sampling draws from: the CPU's, or the device's.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=input_mask.long().to(device),
                                      generation_config=config, stopping_criteria=stopping)
        response_ids = out.sequences[:, input_ids.shape[1]:]
        logprobs = self._sampled_logprobs(out.scores, response_ids).cpu()
        return response_ids.cpu().clone(), logprobs

    @contextmanager
    def _recording(self, forwards: list[list[torch.Tensor]], rows: int):
        """With ``record_routes``: appends, per model forward, each MoE layer's ``[B, s, k]`` top-k.

        A forward hook on every router (``Qwen3MoeTopKRouter``, which returns ``(logits, weights,
        indices)`` for the ``[B * s, H]`` hidden states its block flattened batch-first).
        """
        if not self.record_routes:
            yield
            return

        def hook(router, _inputs, output):
            if router is self.routers[0]:
                forwards.append([])
            forwards[-1].append(output[2].detach().view(rows, -1, output[2].shape[-1]).to(self.route_dtype).cpu())

        handles = [router.register_forward_hook(hook) for router in self.routers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def _routes(forwards: list[list[torch.Tensor]], prompt_mask: torch.Tensor,
                response_mask: torch.Tensor) -> torch.Tensor:
        """:attr:`RolloutBatch.routes` from the forwards of one ``generate``.

        The prefill forward ran the ``[B, P]`` left-padded prompts, then decode forward ``t`` ran
        response token ``t - 1`` of every row (``T - 1`` of them for ``T`` sampled tokens). The
        last sampled token was never fed back, so it has no engine route: it gets a copy of the
        previous position's route. That cannot change a trained log-prob: a causal model's
        output at the last position of a row predicts the token after the response, which is no
        target (``loss_mask`` False there), and no earlier position attends to it. Rows that
        finished earlier had their last token fed back while others still ran, so only the
        longest rows need the copy; left padding and the positions after a row's response are
        dropped by packing (:func:`nemo_sspo.algorithms.batch.pack_rows`).

        Raises:
            ValueError: the forwards do not cover ``P + T - 1`` positions (e.g. a generation mode
                that batches its forwards otherwise).
        """
        engine = torch.cat([torch.stack(layers, dim=2) for layers in forwards], dim=1)  # [B, P + T - 1, L, k]
        width = prompt_mask.shape[1] + response_mask.shape[1]
        if engine.shape[1] != width - 1:
            raise ValueError(f"the engine's forwards covered {engine.shape[1]} positions, expected prompt width + "
                             f"response width - 1 = {width - 1}: routes cannot be matched to tokens")
        engine = torch.cat([engine, engine[:, -1:]], dim=1)
        return pack_rows(engine, torch.cat([prompt_mask, response_mask], dim=1), 0)

    def load_weights(self, hf_state_dict: dict[str, torch.Tensor]) -> None:
        """Refit: copy ``hf_state_dict`` (HF names, any float dtype) into the model in place.

        Keys must match exactly (strict; ``lm_head.weight`` optional when embeddings are tied), and
        every shape must match; see :meth:`load_weight_buckets` (this is its one-bucket case).

        Raises:
            ValueError: missing/unexpected keys or a shape mismatch.
        """
        self.load_weight_buckets([hf_state_dict])

    @torch.no_grad()
    def load_weight_buckets(self, buckets) -> None:
        """Streamed refit: copies each bucket (HF name -> tensor dict, as
        ``nemo_sspo.megatron.iter_hf_weight_buckets`` yields) into the model as it comes
        (``load_state_dict(strict=False)``), then checks that every parameter was set exactly once.

        A bucket's unknown keys or shapes are refused before it is copied; keys set twice or never
        set are found after the copies, when the model is already partly refitted (the trainer then
        stops: the run cannot continue on such weights).

        Raises:
            ValueError: an unknown key, a shape mismatch, a key in two buckets, or a parameter no
                bucket set (``lm_head.weight`` optional when embeddings are tied).
        """
        params = self.model.state_dict()
        seen: set[str] = set()
        for bucket in buckets:
            bucket = fuse_expert_weights(bucket)  # Qwen3-MoE: buckets hold whole layers' experts
            _check_bucket(bucket, params, seen)
            self.model.load_state_dict(bucket, strict=False)
            self._head_weight = None  # recast from the refitted weights at the next forward
            seen.update(bucket)
            del bucket  # release it before the iterator produces the next one
        check_state_dict_keys(self.model, dict.fromkeys(seen))

    def sleep(self) -> None:
        """Nothing to free: the model stays where it is (``RolloutEngine`` protocol)."""

    def wake_up(self) -> None:
        """Nothing to undo (``RolloutEngine`` protocol)."""

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's current (refitted) weights under HF names."""
        return self.model.state_dict()

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named weights as the model holds them (its own tensors, no copy; ``rollout.refit.verify``).

        Args:
            names: HF names as the refit buckets carry them (Qwen3-MoE experts one per expert:
                ``...mlp.experts.{e}.gate_proj.weight``, views of the fused parameters).

        Returns:
            name -> tensor (the model's dtype and device) for each of ``names`` the model has.
        """
        state = self.model.state_dict()
        if self.routers:
            state = split_expert_weights(state)
        return {name: state[name] for name in names if name in state}

    def shutdown(self) -> None:
        """Nothing to release: the model is an ordinary module (``RolloutEngine`` protocol)."""

    def _response_mask(self, response_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` mask up to and including the first stop id, and ``[B]`` truncated flags.

        Found from the first stop position, not from pad ids: SmolLM2 pads with its EOS token.
        """
        is_stop = torch.isin(response_ids, torch.tensor(self.stop_token_ids, dtype=response_ids.dtype))
        seen_before = (is_stop.cumsum(dim=1) - is_stop.long()) > 0  # a stop id strictly earlier in the row
        return ~seen_before, ~is_stop.any(dim=1)

    @staticmethod
    def _sampled_logprobs(scores: tuple[torch.Tensor, ...], response_ids: torch.Tensor) -> torch.Tensor:
        """log-softmax of the processed step scores (``T`` tensors ``[B, V]``) at the sampled ids."""
        steps = [torch.log_softmax(s.float(), dim=-1).gather(1, response_ids[:, t:t + 1])
                 for t, s in enumerate(scores)]
        return torch.cat(steps, dim=1)
