"""NeMo-RL adapter: a nemo_sspo policy loss as a NeMo-RL loss function.

Written against NeMo-RL's documented loss protocol (NVIDIA-NeMo/RL); NeMo-RL is not installable
here (PyPI ``nemo-rl`` 0.0.0 is an empty placeholder), so this module was exercised by calling it
exactly as the host calls it, never inside NeMo-RL itself. Two generations of the protocol exist:

- up to the loss refactor of February 2026 (NVIDIA-NeMo/RL PR #1920; ``ClippedPGLossFn`` in
  ``nemo_rl/algorithms/loss_functions.py``), the policy worker calls
  ``loss_fn(next_token_logits, data, global_valid_seqs, global_valid_toks,
  vocab_parallel_rank=..., vocab_parallel_group=..., context_parallel_group=...)`` with
  vocab-parallel logits ``[B, S, V_local]`` (already divided by the sampling temperature). This
  adapter then computes log-probs (and, on request, entropies) with our fused
  :func:`nemo_sspo.parallel.vocab_parallel_logprobs_entropy`;
- after it (``nemo_rl/algorithms/loss/``), a loss declares ``input_type``; with
  ``LossInputType.LOGPROB`` (what this class declares when that enum exists) the host computes the
  next-token log-probs itself and calls ``loss_fn(data=..., global_valid_seqs=...,
  global_valid_toks=..., next_token_logprobs=[B, S - 1])``; the process groups are no longer
  passed to losses, so the fused op is not used on that path.

Batch (``data``, a ``BatchedDataDict``; NeMo-RL aligns token columns with ``input_ids`` and the
loss reads ``[:, 1:]``): ``input_ids`` [B, S] int64, ``token_mask`` [B, S] (1 at generated
tokens), ``sample_mask`` [B], ``advantages`` [B, S] (the response's advantage at its tokens),
``prev_logprobs`` [B, S] (old policy), and :data:`PREV_ENTROPY_KEY` (old-policy token entropy,
aligned exactly like ``prev_logprobs``, so [B, S] here; NeMo-RL does not produce it: add it in
the worker's log-prob pass with :func:`token_logprobs_and_entropy`, or pass
``old_entropy_source="current"``).

Normalisation follows ``ClippedPGLossFn``: the returned loss is this micro-batch's numerator
divided by the host's global count, ``global_valid_toks`` for "token-mean" (``loss_type`` =
TOKEN_LEVEL), ``global_valid_seqs`` for the response-level modes (SEQUENCE_LEVEL), so the sum over
micro-batches and data-parallel ranks is the global mean. Metrics are ``<key>/sum`` and
``<key>/count`` floats: they stay correct under the host's summation over micro-batches and
ranks; divide the two to read a metric.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from nemo_sspo.algorithms.segmentation import SegmentTables, build_segment_tables
from nemo_sspo.integrations._common import (
    PREV_ENTROPY_KEY,
    bind_loss,
    check_host_config,
    check_old_entropy_source,
    host_loss_sums,
    metric_pairs,
    old_entropy,
    per_response_advantages,
    shifted_logprobs_entropy,
)

__all__ = ["PREV_ENTROPY_KEY", "NeMoRLPolicyLoss", "token_logprobs_and_entropy"]

_CONFIG_KEYS = ("loss_name", "config", "old_entropy_source", "vocab_size", "max_response_length")
_INSTALL_HINT = (
    "Install NeMo-RL from its repository (https://github.com/NVIDIA-NeMo/RL, `uv sync` in a "
    "checkout or `pip install -e` of it); the PyPI name nemo-rl 0.0.0 is an empty placeholder."
)


def _host_enums() -> tuple[Any, Any | None]:
    """NeMo-RL's ``(LossType, LossInputType or None)``, newest protocol first."""
    import importlib

    for module, has_input_type in (("nemo_rl.algorithms.loss.interfaces", True),
                                   ("nemo_rl.algorithms.interfaces", False)):
        try:
            interfaces = importlib.import_module(module)
        except ImportError:
            continue
        input_type = getattr(interfaces, "LossInputType", None) if has_input_type else None
        return interfaces.LossType, input_type
    raise ImportError(f"NeMo-RL is needed for NeMoRLPolicyLoss but neither "
                      f"nemo_rl.algorithms.loss.interfaces nor nemo_rl.algorithms.interfaces "
                      f"imports. {_INSTALL_HINT}")


def token_logprobs_and_entropy(
    next_token_logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    vocab_parallel_rank: int | None,
    vocab_parallel_group,
    vocab_size: int | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[B, S]`` in NeMo-RL's layout (column 0 = 0, as ``prev_logprobs``).

    Use it in the policy worker's log-prob pass to store :data:`PREV_ENTROPY_KEY` next to
    ``prev_logprobs``.

    Args:
        next_token_logits: ``[B, S, V_local]`` vocab-parallel logits (temperature applied).
        input_ids: ``[B, S]`` int64.
        vocab_parallel_rank: rank in ``vocab_parallel_group`` (None without a group).
        vocab_parallel_group: tensor-parallel group, or None for full-vocabulary logits.
        vocab_size: true vocabulary size (excludes Megatron's padding rows); None counts every
            column as NeMo-RL's own log-prob function does.
        mask: ``[B, S - 1]`` bool positions to compute (default all).

    Returns:
        ``(logprobs, entropy)`` ``[B, S]`` float32 (fp64 for fp64 logits).

    Raises:
        ValueError: a group without a rank, or the checks of the fused op.
    """
    if vocab_parallel_group is not None and vocab_parallel_rank is None:
        raise ValueError("vocab_parallel_rank must be given with vocab_parallel_group")
    if mask is None:
        mask = torch.ones(input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.bool,
                          device=input_ids.device)
    logprobs, entropy = shifted_logprobs_entropy(
        next_token_logits, input_ids, mask.bool(), tp_group=vocab_parallel_group,
        tp_rank=vocab_parallel_rank or 0, vocab_size=vocab_size)
    return F.pad(logprobs, (1, 0)), F.pad(entropy, (1, 0))


class NeMoRLPolicyLoss:
    """A registered nemo_sspo loss behind NeMo-RL's loss-function protocol (module docstring).

    Args:
        loss_name: a name of ``nemo_sspo.algorithms.losses.policy_loss_names()`` (default "sspo").
        loss_config: that loss's config instance or a mapping of its fields; None uses the
            defaults. Its ``aggregation``
            sets ``loss_type`` ("token-mean" -> TOKEN_LEVEL, every other mode -> SEQUENCE_LEVEL).
        tables: ``build_segment_tables(tokenizer)``, read by segmentations that look at token
            texts (SSPO's "newline"); segment ids come from ``input_ids``.
        vocab_size: true vocabulary size; None counts every logits column as a token (NeMo-RL's
            own behaviour, which includes Megatron's padding rows).
        old_entropy_source: "batch" reads :data:`PREV_ENTROPY_KEY`; "current" uses the detached
            entropy of the logits being trained, equal to the old policy's only on the first
            optimizer step after each rollout (one step per rollout batch keeps it exact); only
            on the logits path.
        max_response_length: L_max for the "constant-denominator" aggregation; unused otherwise.
        chunk_size: tokens per communication chunk of the fused op.

    Raises:
        ImportError: NeMo-RL is not installed (says how to install it).
        ValueError: unknown loss, wrong config type, bad ``old_entropy_source``; a config this
            adapter cannot run (``kl_coef`` or ``entropy_coef`` > 0, "constant-denominator"
            without ``max_response_length``, a text-reading segmentation without ``tables``).
    """

    def __init__(self, loss_name: str = "sspo", loss_config: Any | None = None, *,
                 tables: SegmentTables | None = None, vocab_size: int | None = None,
                 old_entropy_source: str = "batch", max_response_length: int | None = None,
                 chunk_size: int = 2048):
        loss_type, input_type = _host_enums()
        self.loss = bind_loss(loss_name, loss_config)
        self.loss_config = self.loss.config
        check_old_entropy_source(old_entropy_source, None, (), "NeMo-RL")
        check_host_config(
            self.loss, host="NeMo-RL", max_response_length=max_response_length,
            tables=tables,
            kl_hint="NeMo-RL's own reference-KL penalty (loss_fn.reference_policy_kl_penalty) "
                    "lives in ClippedPGLossFn, which this adapter replaces: a reference-KL "
                    "penalty is not supported with NeMoRLPolicyLoss.",
            entropy_hint="An entropy bonus is not supported with NeMoRLPolicyLoss.")
        self.loss_name = loss_name
        self.per_token_normaliser = self.loss_config.aggregation == "token-mean"
        self.loss_type = loss_type.TOKEN_LEVEL if self.per_token_normaliser else (
            loss_type.SEQUENCE_LEVEL)
        self.input_type = None if input_type is None else input_type.LOGPROB
        self.tables = tables
        self.vocab_size = vocab_size
        self.old_entropy_source = old_entropy_source
        self.max_response_length = max_response_length
        self.chunk_size = chunk_size

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, tokenizer=None) -> NeMoRLPolicyLoss:
        """Build from a recipe section (examples/integrations/nemo_rl/sspo_grpo.yaml).

        Args:
            cfg: mapping with ``loss_name`` (required) and optionally ``config`` (fields of that
                loss's config dataclass), ``old_entropy_source``, ``vocab_size`` and
                ``max_response_length`` (constructor defaults otherwise).
            tokenizer: the recipe's tokenizer; its segment tables are built here (decodes every
                id once) when given.

        Raises:
            ValueError: missing ``loss_name`` or an unknown key (lists the valid ones), or the
                constructor's errors.
        """
        unknown = sorted(set(cfg) - set(_CONFIG_KEYS))
        if unknown or "loss_name" not in cfg:
            raise ValueError(f"the nemo_sspo section needs loss_name and takes only "
                             f"{list(_CONFIG_KEYS)}; got {sorted(cfg)}")
        name = cfg["loss_name"]
        options = {key: cfg[key] for key in _CONFIG_KEYS[2:] if key in cfg}
        return cls(name, dict(cfg["config"]) if "config" in cfg else None,
                   tables=None if tokenizer is None else build_segment_tables(tokenizer),
                   **options)

    def __call__(self, next_token_logits: torch.Tensor | None = None, data=None,
                 global_valid_seqs: torch.Tensor | None = None,
                 global_valid_toks: torch.Tensor | None = None,
                 vocab_parallel_rank: int | None = None, vocab_parallel_group=None,
                 context_parallel_group=None, *,
                 next_token_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch (a scalar to minimise) and its metrics.

        Args:
            next_token_logits: ``[B, S, V_local]`` vocab-parallel logits (pre-2026 protocol), or
                None when ``next_token_logprobs`` is given.
            data: the micro-batch (keys in the module docstring).
            global_valid_seqs: 0-d count of valid responses in the global batch.
            global_valid_toks: 0-d count of valid response tokens in the global batch.
            vocab_parallel_rank: tensor-parallel rank of the logits shard (None: full vocabulary
                on this rank).
            vocab_parallel_group: tensor-parallel group of the logits shard (None: full vocabulary).
            context_parallel_group: must be None or of size 1 (context parallelism is not
                supported: the sequence would be split across ranks).
            next_token_logprobs: ``[B, S - 1]`` log-probs from the host (2026 protocol).

        Returns:
            ``(loss, metrics)``: ``loss`` is 0 with a zero gradient when the global normaliser is
            0 (no valid token or response anywhere), not NaN.

        Raises:
            ValueError: both or neither of logits / log-probs, missing batch keys or normaliser,
                ``old_entropy_source="current"`` without logits, or the loss's own checks.
            NotImplementedError: context parallelism, or DTensor logits.
        """
        if (next_token_logits is None) == (next_token_logprobs is None):
            raise ValueError("pass exactly one of next_token_logits (vocab-parallel logits) or "
                             "next_token_logprobs")
        if context_parallel_group is not None and (
                torch.distributed.get_world_size(context_parallel_group) > 1):
            raise NotImplementedError("context parallelism is not supported by NeMoRLPolicyLoss")
        normaliser = global_valid_toks if self.per_token_normaliser else global_valid_seqs
        if data is None or normaliser is None:
            raise ValueError("data and the global normaliser (global_valid_toks for token-mean, "
                             "global_valid_seqs otherwise) are required")
        input_ids = data["input_ids"]
        mask = data["token_mask"][:, 1:].bool() & data["sample_mask"].bool()[:, None]
        logprobs, current_entropy = self._logprobs(next_token_logits, next_token_logprobs,
                                                   input_ids, mask, vocab_parallel_rank,
                                                   vocab_parallel_group)
        stored_or_current = old_entropy(self.old_entropy_source, data,
                                        None if current_entropy is None else
                                        F.pad(current_entropy, (1, 0)))
        numerator, _, metrics = host_loss_sums(
            self.loss, logprobs=logprobs, old_logprobs=data["prev_logprobs"][:, 1:],
            advantages=per_response_advantages(data["advantages"][:, 1:], mask),
            response_mask=mask, response_ids=input_ids[:, 1:],
            old_entropy=stored_or_current[:, 1:], tables=self.tables,
            max_response_length=self.max_response_length)
        denominator = torch.as_tensor(normaliser, device=numerator.device).to(numerator.dtype)
        # No valid token in the global batch (docs/pitfalls.md#p12): 0 with a zero gradient, not 0/0.
        loss = torch.where(denominator > 0, numerator / denominator.clamp(min=1e-30),
                           numerator * 0)
        out = {"loss": float(loss.detach()), "num_valid_samples": float(data["sample_mask"].sum())}
        out.update(metric_pairs(metrics))
        return loss, out

    def _logprobs(self, logits, logprobs, input_ids, mask, rank, group):
        if logits is None:
            if logprobs.shape != mask.shape:
                raise ValueError(f"next_token_logprobs has shape {tuple(logprobs.shape)}, "
                                 f"expected [B, S - 1] = {tuple(mask.shape)}")
            return logprobs.to(torch.promote_types(logprobs.dtype, torch.float32)), None
        if type(logits).__name__ == "DTensor":
            raise NotImplementedError("DTensor logits (NeMo-RL's DTensor worker) are not "
                                      "supported; use the Megatron worker or plain tensors")
        if group is not None and rank is None:
            raise ValueError("vocab_parallel_rank must be given with vocab_parallel_group")
        return shifted_logprobs_entropy(logits, input_ids, mask, tp_group=group,
                                        tp_rank=rank or 0, vocab_size=self.vocab_size,
                                        chunk_size=self.chunk_size)
