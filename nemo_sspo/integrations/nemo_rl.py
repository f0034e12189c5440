"""NeMo-RL adapter: a nemo_sspo policy loss as a NeMo-RL ``LossFunction`` of today's protocol.

Checked against NeMo-RL at commit 7ea279a (2026-08-22; ``nemo_rl/algorithms/loss/``, the loss
package of PR #1920, with ``MetricNormalizer``): ``tools/record_nemo_rl.py`` runs NeMo-RL's own
``ClippedPGLossFn`` and input preparation, and ``tests/integration/test_nemo_rl_recorded.py``
checks this adapter against the recorded figures.

Protocol. A NeMo-RL loss declares ``loss_type`` and ``input_type``; the policy worker's
``prepare_loss_input`` turns the model output into the loss's input and calls
``loss_fn(data=..., global_valid_seqs=..., global_valid_toks=..., **loss_input)``:

- ``LossInputType.LOGPROB``: ``next_token_logprobs`` ``[B, S - 1]`` (the host's vocab-parallel,
  packed, chunked or fused-linear log-prob path, temperature applied). Declared when the loss does
  not read the old-policy entropy (GRPO, DAPO, GSPO, CISPO, ...) or reads it from the batch
  (``old_entropy_source="batch"``).
- ``LossInputType.LOGIT``: ``logits`` ``[B, S', V_local]`` as the model returns them, temperature
  applied; ``S' >= S`` when the host packs sequences (``SequencePackingLossWrapper`` hands one
  padded sequence at a time). Declared for SSPO's entropy clip with ``old_entropy_source=
  "current"`` (the default): log-probs and entropies then come from our fused
  :func:`nemo_sspo.parallel.vocab_parallel_logprobs_entropy`. NeMo-RL passes no process group to a
  loss, so the vocabulary shard is read from the logits: a DTensor's mesh (DTensor worker), else
  Megatron's ``parallel_state`` tensor-parallel group when it is initialised (Megatron worker),
  else the full vocabulary.

Old-policy entropy (SSPO eq. 12). NeMo-RL's log-prob pass (``policy.get_logprobs``) returns no
entropy, and adding it would mean editing its workers. So by default (``"current"``) the
entropy is the detached entropy of the logits being trained: on the first optimizer step after
each rollout the trained policy is the old policy, so it is exact when each rollout batch gets
one optimizer step (``policy.train_global_batch_size = grpo.num_prompts_per_step x
grpo.num_generations_per_prompt``, which :func:`prepare_master_config` requires). For several
steps per rollout, store :data:`PREV_ENTROPY_KEY` ``[B, S]`` next to ``prev_logprobs`` in a
custom log-prob pass with :func:`token_logprobs_and_entropy` and use ``"batch"``.

Batch (``data``): the keys of ``grpo_train``'s ``train_data``, ``[B, S]`` columns aligned with
``input_ids`` and read as ``[:, 1:]``: ``input_ids``, ``token_mask``, ``sample_mask`` [B],
``advantages`` (A_i at every token of response i), ``prev_logprobs``; also
``reference_policy_logprobs`` when the loss has ``kl_coef > 0``. ``input_lengths`` and
``generation_logprobs`` are present and not read. A missing key is refused with its name and the
host step that produces it.

Normalisation follows ``ClippedPGLossFn``: this micro-batch's numerator over the host's global
count, ``global_valid_toks`` for "token-mean" (``loss_type`` TOKEN_LEVEL) and ``global_valid_seqs``
otherwise (SEQUENCE_LEVEL), so micro-batch losses sum to the global mean. Metrics are
``<key>/sum`` and ``<key>/count`` floats (exact under the host's summation over micro-batches and
ranks: divide the two) plus ``loss`` and ``num_valid_samples``; ``metric_normalizations``
advertises each one's denominator to NeMo-RL's split-API trainer.
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
    import_host,
    metric_pairs,
    per_response_advantages,
    shifted_logprobs_entropy,
)

__all__ = ["PREV_ENTROPY_KEY", "NeMoRLPolicyLoss", "prepare_master_config",
           "token_logprobs_and_entropy"]

SECTION = "nemo_sspo"
"""The master-config key (YAML section) this adapter reads."""
_CONFIG_KEYS = ("loss_name", "config", "old_entropy_source", "vocab_size", "max_response_length")
_INSTALL_HINT = (
    "Install NeMo-RL from its repository (https://github.com/NVIDIA-NeMo/RL, `uv sync` in a "
    "checkout); the PyPI name nemo-rl 0.0.0 is an empty placeholder. This adapter needs the loss "
    "interface of NeMo-RL's PR #1920 (2026) with MetricNormalizer (commit 7ea279a or later)."
)
# Where each batch key comes from in NeMo-RL's grpo_train, for the missing-key error.
_PRODUCERS = {
    "input_ids": "grpo_train's train_data (flat_messages['token_ids'])",
    "token_mask": "grpo_train's train_data (flat_messages['token_loss_mask'])",
    "sample_mask": "grpo_train's train_data (repeated_batch['loss_multiplier'])",
    "advantages": "grpo_train's advantage estimator (adv_estimator.compute_advantage)",
    "prev_logprobs": "policy.get_logprobs in grpo_train",
    "reference_policy_logprobs": (
        "policy.get_reference_policy_logprobs in grpo_train, which runs when "
        "loss_fn.reference_policy_kl_penalty > 0 and grpo.skip_reference_policy_logprobs_"
        "calculation is false (prepare_master_config sets both for a loss with kl_coef > 0)"),
    PREV_ENTROPY_KEY: (
        "nothing in NeMo-RL: store it in the log-prob pass with token_logprobs_and_entropy(), "
        "or use old_entropy_source='current'"),
}


def _host_interfaces():
    """NeMo-RL's ``(LossType, LossInputType, MetricNormalizer)``."""
    interfaces = import_host("nemo_rl.algorithms.loss.interfaces", "NeMo-RL", _INSTALL_HINT)
    missing = [name for name in ("LossType", "LossInputType", "MetricNormalizer")
               if not hasattr(interfaces, name)]
    if missing:
        raise ImportError(f"nemo_rl.algorithms.loss.interfaces lacks {missing}: this NeMo-RL is "
                          f"older than the interface this adapter targets. {_INSTALL_HINT}")
    return interfaces.LossType, interfaces.LossInputType, interfaces.MetricNormalizer


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

    The extension for ``old_entropy_source="batch"``: call it in a custom log-prob pass of the
    policy worker and store the entropy as :data:`PREV_ENTROPY_KEY` next to ``prev_logprobs``.

    Args:
        next_token_logits: ``[B, S, V_local]`` vocab-parallel logits (temperature applied).
        input_ids: ``[B, S]`` int64.
        vocab_parallel_rank: rank in ``vocab_parallel_group`` (None without a group).
        vocab_parallel_group: tensor-parallel group, or None for full-vocabulary logits.
        vocab_size: true vocabulary size (excludes Megatron's padding rows); None counts every
            column as NeMo-RL's own log-prob function does.
        mask: ``[B, S - 1]`` bool positions to compute (default all).

    Returns:
        ``(logprobs, entropy)`` ``[B, S]`` float32 (fp64 for fp64 logits), entropy in nats.

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


class _PairNormalizations(dict):
    """``metric_normalizations`` whose ``<key>/sum`` / ``<key>/count`` entries are raw sums."""

    def __init__(self, entries, none):
        super().__init__(entries)
        self._none = none

    def get(self, key, default=None):
        """The advertised normaliser of metric ``key``; NONE for every (sum, count) pair entry."""
        if key in self:
            return self[key]
        return self._none if key.endswith(("/sum", "/count")) else default


class NeMoRLPolicyLoss:
    """A registered nemo_sspo loss as a NeMo-RL ``LossFunction`` (module docstring).

    Args:
        loss_name: a name of ``nemo_sspo.algorithms.losses.policy_loss_names()`` (default "sspo").
        loss_config: that loss's config instance or a mapping of its fields; None uses the
            defaults. Its ``aggregation`` sets ``loss_type`` ("token-mean" -> TOKEN_LEVEL, every
            other mode -> SEQUENCE_LEVEL); ``kl_coef > 0`` reads
            ``data["reference_policy_logprobs"]``.
        tables: ``build_segment_tables(tokenizer)``, read by segmentations that look at token
            texts (SSPO's "newline"); segment ids come from ``input_ids``.
        vocab_size: true vocabulary size for the logits path; None counts every logits column as
            a token (NeMo-RL's own convention, which its ``prev_logprobs`` follow).
        old_entropy_source: "current" (logits path; exact on the first optimizer step after a
            rollout) or "batch" (reads :data:`PREV_ENTROPY_KEY`); only read by losses that use
            the old entropy (SSPO).
        max_response_length: L_max for the "constant-denominator" aggregation; unused otherwise.
        use_fused_linear_logprobs: NeMo-RL's ``policy.megatron_cfg.use_fused_linear_logprobs``:
            the model then returns log-probs, not logits (log-prob input only).
        chunk_size: tokens per communication chunk of the fused op (logits path).

    Attributes:
        loss_type: NeMo-RL ``LossType``.
        input_type: NeMo-RL ``LossInputType.LOGIT`` or ``LOGPROB`` (module docstring).
        metric_normalizations: NeMo-RL ``MetricNormalizer`` of every returned metric.

    Raises:
        ImportError: NeMo-RL is missing or older than this interface (says how to install it).
        ValueError: unknown loss, wrong config type, bad ``old_entropy_source``; a config this
            adapter cannot run (``entropy_coef`` > 0, "constant-denominator" without
            ``max_response_length``, a text-reading segmentation without ``tables``, the logits
            path with ``use_fused_linear_logprobs``).
    """

    def __init__(self, loss_name: str = "sspo", loss_config: Any | None = None, *,
                 tables: SegmentTables | None = None, vocab_size: int | None = None,
                 old_entropy_source: str = "current", max_response_length: int | None = None,
                 use_fused_linear_logprobs: bool = False, chunk_size: int = 2048):
        """Bind the loss and check it against what NeMo-RL passes (class docstring)."""
        loss_type, input_type, normalizer = _host_interfaces()
        self.loss = bind_loss(loss_name, loss_config)
        self.loss_config = self.loss.config
        check_old_entropy_source(old_entropy_source, None, (), "NeMo-RL")
        check_host_config(
            self.loss, host="NeMo-RL", max_response_length=max_response_length,
            tables=tables, reference_logprobs=True, kl_hint="",
            entropy_hint="An entropy bonus is not supported with NeMoRLPolicyLoss.")
        needs = self.loss.requirements
        self.reads_old_entropy = needs.old_entropy
        self.needs_logits = needs.old_entropy and old_entropy_source == "current"
        if self.needs_logits and use_fused_linear_logprobs:
            raise ValueError(
                f"{loss_name} with old_entropy_source='current' needs logits for the old-policy "
                "entropy, but use_fused_linear_logprobs=True makes NeMo-RL's model return "
                "log-probs only: set policy.megatron_cfg.use_fused_linear_logprobs=false, or "
                f"store data[{PREV_ENTROPY_KEY!r}] and use old_entropy_source='batch'")
        self.loss_name = loss_name
        self.per_token_normaliser = self.loss_config.aggregation == "token-mean"
        self.loss_type = loss_type.TOKEN_LEVEL if self.per_token_normaliser else (
            loss_type.SEQUENCE_LEVEL)
        self.input_type = input_type.LOGIT if self.needs_logits else input_type.LOGPROB
        self.metric_normalizations = _PairNormalizations(
            {"loss": normalizer.TOKENS if self.per_token_normaliser else normalizer.SEQUENCES,
             "num_valid_samples": normalizer.NONE}, normalizer.NONE)
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.tables = tables
        self.vocab_size = vocab_size
        self.old_entropy_source = old_entropy_source
        self.max_response_length = max_response_length
        self.chunk_size = chunk_size
        self.required_keys = ("input_ids", "token_mask", "sample_mask", "advantages",
                              "prev_logprobs") + (
            ("reference_policy_logprobs",) if needs.reference_policy else ()) + (
            (PREV_ENTROPY_KEY,) if needs.old_entropy and old_entropy_source == "batch" else ())

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, tokenizer=None,
                    use_fused_linear_logprobs: bool = False) -> NeMoRLPolicyLoss:
        """Build from the ``nemo_sspo`` section (examples/integrations/nemo_rl/sspo_grpo.yaml).

        Args:
            cfg: mapping with ``loss_name`` (required) and optionally ``config`` (fields of that
                loss's config dataclass), ``old_entropy_source``, ``vocab_size`` and
                ``max_response_length`` (constructor defaults otherwise).
            tokenizer: the recipe's tokenizer; its segment tables are built here (decodes every
                id once) when given.
            use_fused_linear_logprobs: as the constructor's.

        Returns:
            The loss function.

        Raises:
            ValueError: missing ``loss_name`` or an unknown key (lists the valid ones), or the
                constructor's errors.
        """
        unknown = sorted(set(cfg) - set(_CONFIG_KEYS))
        if unknown or "loss_name" not in cfg:
            raise ValueError(f"the {SECTION} section needs loss_name and takes only "
                             f"{list(_CONFIG_KEYS)}; got {sorted(cfg)}")
        options = {key: cfg[key] for key in _CONFIG_KEYS[2:] if key in cfg}
        return cls(cfg["loss_name"], dict(cfg["config"]) if cfg.get("config") else None,
                   tables=None if tokenizer is None else build_segment_tables(tokenizer),
                   use_fused_linear_logprobs=use_fused_linear_logprobs, **options)

    def __call__(self, data, global_valid_seqs: torch.Tensor, global_valid_toks: torch.Tensor,
                 *, next_token_logprobs: torch.Tensor | None = None,
                 logits: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch (a scalar to minimise) and its metrics.

        Args:
            data: the micro-batch (``BatchedDataDict``; keys in the module docstring).
            global_valid_seqs: 0-d count of valid responses in the global batch.
            global_valid_toks: 0-d count of valid response tokens in the global batch.
            next_token_logprobs: ``[B, S - 1]`` current log-probs (``input_type`` LOGPROB).
            logits: ``[B, S', V_local]`` logits with ``S' >= S`` (``input_type`` LOGIT).

        Returns:
            ``(loss, metrics)``: ``loss`` is 0 with a zero gradient when the global normaliser is
            0 (no valid token or response anywhere), not NaN.

        Raises:
            ValueError: the input of the other ``input_type``, a missing batch key (named, with
                what produces it), bad shapes, or the loss's own checks.
            NotImplementedError: context-parallel or sequence-sharded logits.
        """
        expected, given = ("logits", logits) if self.needs_logits else (
            "next_token_logprobs", next_token_logprobs)
        if given is None or (logits is not None and next_token_logprobs is not None):
            raise ValueError(f"input_type is {self.input_type}: pass {expected}= only (NeMo-RL's "
                             "prepare_loss_input does so from input_type)")
        missing = [key for key in self.required_keys if key not in data]
        if missing:
            raise ValueError("the NeMo-RL batch lacks " + "; ".join(
                f"{key!r} (produced by {_PRODUCERS[key]})" for key in missing))
        input_ids = data["input_ids"]
        mask = data["token_mask"][:, 1:].bool() & data["sample_mask"].bool()[:, None]
        if self.needs_logits:
            current, entropy = self._from_logits(logits, input_ids, mask)
        else:
            current, entropy = self._host_logprobs(next_token_logprobs, mask), None
        if self.reads_old_entropy and entropy is None:
            entropy = self._stored_entropy(data)
        numerator, _, metrics = host_loss_sums(
            self.loss, logprobs=current, old_logprobs=data["prev_logprobs"][:, 1:],
            advantages=per_response_advantages(data["advantages"][:, 1:], mask),
            response_mask=mask, response_ids=input_ids[:, 1:], old_entropy=entropy,
            tables=self.tables, max_response_length=self.max_response_length,
            ref_logprobs=(data["reference_policy_logprobs"][:, 1:]
                          if "reference_policy_logprobs" in self.required_keys else None))
        normaliser = global_valid_toks if self.per_token_normaliser else global_valid_seqs
        denominator = torch.as_tensor(normaliser, device=numerator.device).to(numerator.dtype)
        # No valid token in the global batch (docs/pitfalls.md#p12): 0 with a zero gradient, not 0/0.
        loss = torch.where(denominator > 0, numerator / denominator.clamp(min=1e-30),
                           numerator * 0)
        out = {"loss": float(loss.detach()), "num_valid_samples": float(data["sample_mask"].sum())}
        out.update(metric_pairs(metrics))
        return loss, out

    @staticmethod
    def _host_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if logprobs.shape != mask.shape:
            raise ValueError(f"next_token_logprobs has shape {tuple(logprobs.shape)}, "
                             f"expected [B, S - 1] = {tuple(mask.shape)}")
        return logprobs.to(torch.promote_types(logprobs.dtype, torch.float32))

    def _from_logits(self, logits, input_ids, mask):
        local, group, rank = _vocab_shard(logits)
        rows, length = input_ids.shape
        if local.dim() != 3 or local.shape[0] != rows or local.shape[1] < length:
            raise ValueError(f"logits have shape {tuple(local.shape)}, expected [B, S', V_local] "
                             f"with B = {rows} and S' >= S = {length}")
        # Packed hosts hand one padded sequence with unpadded data: the tail is padding.
        return shifted_logprobs_entropy(local[:, :length], input_ids, mask, tp_group=group,
                                        tp_rank=rank, vocab_size=self.vocab_size,
                                        chunk_size=self.chunk_size)

    @staticmethod
    def _stored_entropy(data) -> torch.Tensor:
        stored, reference = data[PREV_ENTROPY_KEY], data["prev_logprobs"]
        if stored.shape != reference.shape:
            raise ValueError(f"data[{PREV_ENTROPY_KEY!r}] has shape {tuple(stored.shape)} but "
                             f"prev_logprobs has {tuple(reference.shape)}; store it aligned "
                             "exactly like prev_logprobs")
        return stored[:, 1:]


def _vocab_shard(logits: torch.Tensor):
    """``(local logits, vocab group or None, rank)`` of the logits NeMo-RL hands a LOGIT loss."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        sharded = [(i, p) for i, p in enumerate(logits.placements) if p.is_shard()]
        if any(p.dim % logits.ndim != logits.ndim - 1 for _, p in sharded) or len(sharded) > 1 or (
                sharded and logits.shape[-1] % logits.device_mesh.size(sharded[0][0])):
            raise NotImplementedError(f"DTensor logits with placements {logits.placements}: only "
                                      "an even vocabulary sharding over one mesh dimension is "
                                      "supported (no sequence or context sharding)")
        if not sharded:
            return logits.to_local(), None, 0
        mesh_dim = sharded[0][0]
        return (logits.to_local(), logits.device_mesh.get_group(mesh_dim),
                logits.device_mesh.get_local_rank(mesh_dim))
    try:
        from megatron.core import parallel_state
    except ImportError:
        return logits, None, 0
    if not parallel_state.model_parallel_is_initialized():
        return logits, None, 0
    if parallel_state.get_context_parallel_world_size() > 1:
        raise NotImplementedError("context parallelism is not supported by NeMoRLPolicyLoss's "
                                  "logits path (policy.megatron_cfg.context_parallel_size=1)")
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits, None, 0
    return (logits, parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_tensor_model_parallel_rank())


def _get(config, key: str, default=None):
    """``config.key`` of a pydantic model (NeMo-RL's MasterConfig) or a TypedDict/mapping."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _set(config, key: str, value) -> None:
    if isinstance(config, dict):
        config[key] = value
    else:
        setattr(config, key, value)


def prepare_master_config(master_config) -> dict[str, Any]:
    """Check NeMo-RL's master config for the nemo_sspo loss and set its reference-KL switch.

    Call it before ``grpo.setup()``. It reads ``master_config.nemo_sspo`` (NeMo-RL's
    ``MasterConfig`` is a pydantic model with extra keys allowed, so the section rides in the
    same YAML), then:

    - reference-KL: NeMo-RL loads a reference model and runs its log-prob pass when
      ``loss_fn.reference_policy_kl_penalty > 0``. ClippedPGLossFn, which reads that penalty, is
      replaced, so it is set to 0 (and ``grpo.skip_reference_policy_logprobs_calculation`` to
      true) unless the nemo_sspo loss has ``kl_coef > 0``; then it is set to that ``kl_coef`` and
      the pass is kept, only to produce ``reference_policy_logprobs``.
    - refuses settings under which the batch would be wrong for these losses:
      ``loss_fn.force_on_policy_ratio`` (``prev_logprobs`` left zero), more than one optimizer
      step per rollout with ``old_entropy_source: current`` (the entropy would not be the old
      policy's), and, on the logits path, top-k/top-p training-time filtering (``prev_logprobs``
      filtered, ours not) or ``policy.sequence_packing.fuse_loss`` (log-probs only).

    Args:
        master_config: NeMo-RL's ``MasterConfig`` (or a mapping with the same keys).

    Returns:
        The ``nemo_sspo`` section as a plain dict, ``max_response_length`` filled from
        ``policy.generation.max_new_tokens`` when absent.

    Raises:
        ValueError: naming the YAML key and the fix.
    """
    section = _get(master_config, SECTION)
    if not isinstance(section, Mapping) or "loss_name" not in section:
        raise ValueError(f"master_config.{SECTION} must be a mapping with at least loss_name "
                         f"(examples/integrations/nemo_rl/sspo_grpo.yaml); got {section!r}")
    section = dict(section)
    policy, grpo, loss_cfg = (_get(master_config, key) for key in ("policy", "grpo", "loss_fn"))
    generation = _get(policy, "generation") or {}
    section.setdefault("max_response_length", _get(generation, "max_new_tokens"))
    loss = bind_loss(section["loss_name"], section.get("config") or None)
    needs = loss.requirements
    if _get(loss_cfg, "force_on_policy_ratio", False):
        raise ValueError("loss_fn.force_on_policy_ratio=true makes grpo_train skip "
                         "policy.get_logprobs and leave prev_logprobs zero, which nemo_sspo "
                         "losses read: set loss_fn.force_on_policy_ratio=false")
    source = section.get("old_entropy_source", "current")
    if needs.old_entropy and source == "current":
        rollout = _get(grpo, "num_prompts_per_step") * _get(grpo, "num_generations_per_prompt")
        if _get(policy, "train_global_batch_size") != rollout:
            raise ValueError(
                f"{SECTION}.old_entropy_source=current is exact only with one optimizer step per "
                f"rollout: set policy.train_global_batch_size={rollout} (grpo.num_prompts_per_step "
                "x grpo.num_generations_per_prompt), or store prev_entropy and use 'batch'")
        packing = _get(policy, "sequence_packing") or {}
        if _get(packing, "enabled", False) and _get(packing, "fuse_loss", False):
            raise ValueError(f"{SECTION}.old_entropy_source=current needs logits, but "
                             "policy.sequence_packing.fuse_loss=true passes log-probs only: set "
                             "it to false")
        top_k, top_p = _get(generation, "top_k"), _get(generation, "top_p", 1.0)
        if (top_k not in (None, 0, -1)) or (top_p is not None and top_p < 1.0):
            raise ValueError(f"{SECTION}.old_entropy_source=current computes log-probs from the "
                             f"full logits, but policy.generation.top_k={top_k} / top_p={top_p} "
                             "filter NeMo-RL's prev_logprobs: set top_k=null and top_p=1.0")
    kl_coef = loss.config.kl_coef if needs.reference_policy else 0.0
    _set(loss_cfg, "reference_policy_kl_penalty", kl_coef)
    _set(grpo, "skip_reference_policy_logprobs_calculation", not needs.reference_policy)
    return section
