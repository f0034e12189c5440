"""verl adapter: every nemo_sspo policy loss as a verl policy loss (written against verl 0.9.1).

verl picks its policy loss by name (``actor_rollout_ref.actor.policy_loss.loss_mode``) from
``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY`` and calls it as::

    pg_loss, pg_metrics = fn(old_log_prob=[B, T], log_prob=[B, T], advantages=[B, T],
                             response_mask=[B, T], loss_agg_mode=str, config=ActorConfig,
                             rollout_is_weights=[B, T] | None)

:func:`register` adds each loss of :func:`nemo_sspo.algorithms.losses.policy_loss_names` under
``"nemo_sspo_<name>"`` (``nemo_sspo_sspo``, ``nemo_sspo_lpo``, ...; new losses appear without
changes here). The adapter computes our per-token loss and reduces it with verl's own
``agg_loss(..., **config.global_batch_info)``, so verl's global-batch normalisation (dp size,
global token / sequence counts) applies unchanged.

Settings. A ``nemo_sspo_*`` loss takes every setting from its own config dataclass: the class
defaults, overridden by ``loss_args`` (``register(loss_args={"sspo": {"gamma": 2.2}})`` or the
JSON environment variable ``NEMO_SSPO_VERL_LOSS_ARGS``, which
:mod:`nemo_sspo.integrations.verl_plugin` reads with :func:`loss_args_from_env`). verl's
``clip_ratio*``, ``clip_ratio_c`` and ``tau_*`` are not read (their meaning differs between our
losses, e.g. DCPO's eps are probability budgets). verl decides the reduction
(``loss_agg_mode``) and the advantages (``algorithm.norm_adv_by_std_in_grpo``), so
:func:`register` rejects ``aggregation`` in ``loss_args`` (a loss config has no advantage setting); for
``nemo_sspo_dr_grpo`` set ``loss_agg_mode=seq-mean-token-sum-norm`` and
``algorithm.norm_adv_by_std_in_grpo=false`` in verl. Reference KL and entropy bonus are verl's
(``use_kl_loss``/``kl_loss_coef``, ``entropy_coeff``): ``kl_coef``/``entropy_coef`` > 0 are
rejected. verl's
``global_batch_info`` and ``rollout_is_weights`` are applied as in verl's own losses.

What verl's signature lacks. The losses also need, per micro-batch, segment ids of the response
tokens ``[B, T]`` and the old policy's token entropy ``[B, T]`` (SSPO eq. 12). They reach the loss
through :func:`loss_inputs`, a context manager the caller opens around the verl call. In verl's
own PPO trainer, :func:`install` (run in every verl process by
``VERL_USE_EXTERNAL_MODULES=nemo_sspo.integrations.verl_plugin``) does this with two hooks:

1. ``RayPPOTrainer._compute_old_log_prob`` (driver): verl already computes the old policy's
   entropy in that pass (``calculate_entropy=True``) but drops it; the hook keeps a copy under
   :data:`OLD_ENTROPY_KEY` and adds :data:`SEGMENT_IDS_KEY`, the segment ids of ``responses``
   built with the trainer's tokenizer, so both travel with the batch to the actor workers.
2. ``verl.workers.utils.losses.ppo_loss`` (actor workers): wrapped to open :func:`loss_inputs`
   with the micro-batch's two columns before calling verl's ``ppo_loss``.

Without these hooks (a custom actor loop), compute both yourself: segment ids with
``nemo_sspo.algorithms.segmentation.segment_ids`` from the response token ids, old entropy in the
same forward pass as the old log-probs (``vocab_parallel_logprobs_entropy`` gives both), and call
verl's loss inside ``with loss_inputs(segment_ids=..., old_entropy=...)``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from nemo_sspo.algorithms.losses import LossInputs, policy_loss_names
from nemo_sspo.algorithms.segmentation import build_segment_tables
from nemo_sspo.integrations._common import (
    bind_loss,
    check_host_config,
    import_host,
    per_response_advantages,
    response_segment_ids,
)
from nemo_sspo.metrics import MetricPair, summarize_metric_pairs

__all__ = [
    "OLD_ENTROPY_KEY",
    "PREFIX",
    "SEGMENT_IDS_KEY",
    "VERL_VERSION",
    "LOSS_ARGS_ENV",
    "install",
    "loss_args_from_env",
    "loss_inputs",
    "register",
    "wrap_ppo_loss",
]

VERL_VERSION = "0.9.1"
"""The verl release this adapter was written and tested against."""
PREFIX = "nemo_sspo_"
"""Prefix of our names in verl's registry (``nemo_sspo_sspo``, ...)."""
OLD_ENTROPY_KEY = "nemo_sspo_old_entropy"
"""Batch column ``[B, T]`` float32: old-policy token entropy (nats) of each response token."""
SEGMENT_IDS_KEY = "nemo_sspo_segment_ids"
"""Batch column ``[B, T]`` int64: segment id of each response token (-1 masked)."""
LOSS_ARGS_ENV = "NEMO_SSPO_VERL_LOSS_ARGS"
"""Environment variable holding ``loss_args`` as JSON, read by :func:`loss_args_from_env`."""

_INSTALL_HINT = (
    f"For the policy-loss registry alone, install it as install.sh does, without letting pip "
    f"replace torch: pip install --no-deps verl=={VERL_VERSION} ray==2.60.0 tensordict==0.10.0 "
    "and the few packages listed there. verl's trainer needs a full verl install."
)


@dataclass(frozen=True)
class _ExtraInputs:
    segment_ids: torch.Tensor
    old_entropy: torch.Tensor


_VERL_OWNED_FIELDS = {
    "aggregation": "verl reduces every policy loss with its own "
                   "actor_rollout_ref.actor.loss_agg_mode (e.g. 'seq-mean-token-sum-norm' for "
                   "Dr. GRPO's constant denominator), so a loss's aggregation is never read",
}
"""Config fields verl decides itself; :func:`register` rejects them in ``loss_args``."""

_EXTRA: ContextVar[_ExtraInputs | None] = ContextVar("nemo_sspo_verl_inputs", default=None)
_LOSSES: dict[str, Any] = {}  # our loss name -> bound loss, built by register()


def _core_algos():
    return import_host("verl.trainer.ppo.core_algos", f"verl (tested: {VERL_VERSION})",
                       _INSTALL_HINT)


@contextlib.contextmanager
def loss_inputs(*, segment_ids: torch.Tensor, old_entropy: torch.Tensor) -> Iterator[None]:
    """Give the ``nemo_sspo_*`` verl losses called inside the block their extra inputs.

    Args:
        segment_ids: ``[B, T]`` int64 segment ids of the response tokens of this micro-batch
            (``nemo_sspo.algorithms.segmentation.segment_ids`` with the loss's segmentation), in
            the layout of verl's ``response_mask``; masked positions are not read.
        old_entropy: ``[B, T]`` float, old-policy token entropy in nats over the full vocabulary.

    Context-local (``contextvars``): nested blocks and threads do not see each other's inputs.
    """
    token = _EXTRA.set(_ExtraInputs(segment_ids, old_entropy))
    try:
        yield
    finally:
        _EXTRA.reset(token)


def _loss_for(name: str) -> Any:
    """Our loss ``name`` bound to the config :func:`register` built (defaults + ``loss_args``)."""
    if name not in _LOSSES:
        raise RuntimeError(f"loss {name!r} has no config: call nemo_sspo.integrations.verl."
                           "register() after the loss was registered")
    return _LOSSES[name]


def _extra_inputs(name: str, shape: torch.Size) -> _ExtraInputs:
    extra = _EXTRA.get()
    if extra is None:
        raise RuntimeError(
            f"verl loss {PREFIX + name!r} needs the micro-batch's segment ids and old-policy "
            "entropy, which verl's policy-loss signature does not carry: run "
            "nemo_sspo.integrations.verl.install() in every verl process (set "
            "VERL_USE_EXTERNAL_MODULES=nemo_sspo.integrations.verl_plugin), or call the loss "
            "inside `with loss_inputs(segment_ids=..., old_entropy=...)`"
        )
    for what, tensor in (("segment_ids", extra.segment_ids), ("old_entropy", extra.old_entropy)):
        if tensor.shape != shape:
            raise ValueError(f"loss_inputs {what} has shape {tuple(tensor.shape)} but verl's "
                             f"log_prob has shape {tuple(shape)}")
    return extra


def _integer_segment_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """``segment_ids`` as int64; float ids must hold whole numbers (``.long()`` would truncate)."""
    if segment_ids.dtype == torch.bool:
        raise ValueError("loss_inputs segment_ids must be an integer tensor, got torch.bool")
    if segment_ids.is_floating_point() or segment_ids.is_complex():
        if not bool(torch.isfinite(segment_ids).all()) or bool(
                (segment_ids != torch.round(segment_ids)).any()):
            raise ValueError(f"loss_inputs segment_ids ({segment_ids.dtype}) hold non-integer "
                             "values; pass int64 segment ids (nemo_sspo.algorithms.segmentation."
                             "segment_ids)")
    return segment_ids.long()


def _verl_metrics(metrics: dict[str, MetricPair], log_prob, old_log_prob, mask) -> dict:
    """Python floats (verl averages them over micro-batches): ours plus verl's usual keys."""
    values = summarize_metric_pairs(metrics)
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        values["actor/ppo_kl"] = float(((old_log_prob - log_prob) * mask).sum() / tokens)
    if "policy/clipfrac_tokens" in values:
        values["actor/pg_clipfrac"] = values["policy/clipfrac_tokens"]
    return values


def _make_verl_loss(name: str):
    """The verl-signature function for our loss ``name`` (verl passes every argument by name)."""

    def policy_loss(old_log_prob, log_prob, advantages, response_mask,
                    loss_agg_mode: str = "token-mean", config=None, rollout_is_weights=None):
        if config is None:
            raise ValueError(f"verl loss {PREFIX + name!r} needs config= (verl's ActorConfig)")
        core = _core_algos()
        mask = response_mask.bool()
        extra = _extra_inputs(name, log_prob.shape)
        out = _loss_for(name)(LossInputs(
            logprobs=log_prob, old_logprobs=old_log_prob,
            advantages=per_response_advantages(advantages, mask), response_mask=mask,
            segment_ids=_integer_segment_ids(extra.segment_ids),
            old_entropy=extra.old_entropy.to(log_prob.dtype)))
        per_token, metrics = out.per_token_loss, out.metrics
        if rollout_is_weights is not None:  # verl's rollout correction, applied as in its losses
            per_token = per_token * rollout_is_weights
        batch_info = dict(getattr(config, "global_batch_info", None) or {})
        pg_loss = core.agg_loss(loss_mat=per_token, loss_mask=mask, loss_agg_mode=loss_agg_mode,
                                **batch_info)
        return pg_loss, _verl_metrics(metrics, log_prob.detach(), old_log_prob, mask)

    policy_loss.__name__ = policy_loss.__qualname__ = f"{PREFIX}{name}"
    policy_loss.__doc__ = f"nemo_sspo loss {name!r} in verl's policy-loss signature."
    policy_loss._nemo_sspo_loss = name
    return policy_loss


def register(loss_args: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """Add every nemo_sspo loss to verl's policy-loss registry as ``nemo_sspo_<name>``.

    Idempotent: a second call replaces our entries (and their ``loss_args``).

    Args:
        loss_args: loss name (ours, without prefix) -> fields of that loss's config dataclass,
            e.g. ``{"sspo": {"alpha": 0.1, "gamma": 2.2}}``; unnamed losses use their defaults.

    Returns:
        The registered verl names, sorted.

    Raises:
        ImportError: verl is not installed (says how to install it).
        ValueError: unknown loss name, unknown field or invalid value (each config is built
            once here so errors show at start-up); a field verl decides itself (``aggregation``:
            verl's ``loss_agg_mode``); ``kl_coef`` / ``entropy_coef`` > 0 (verl
            passes neither reference log-probs nor entropy to a policy loss: use verl's
            ``use_kl_loss`` / ``kl_loss_coef`` and ``entropy_coeff``); or a name clash with a loss
            verl registered.
    """
    core = _core_algos()
    loss_args = {name: dict(args) for name, args in (loss_args or {}).items()}
    unknown = sorted(set(loss_args) - set(policy_loss_names()))
    if unknown:
        raise ValueError(f"loss_args names unknown loss(es) {unknown}; ours: {policy_loss_names()}")
    for name, args in loss_args.items():
        ignored = sorted(set(args) & set(_VERL_OWNED_FIELDS))
        if ignored:
            raise ValueError(
                f"loss_args[{name!r}] sets {ignored}, which verl does not let a policy loss "
                f"choose: {'; '.join(_VERL_OWNED_FIELDS[key] for key in ignored)}. Remove them "
                "from loss_args")
    losses = {name: bind_loss(name, loss_args.get(name, {})) for name in policy_loss_names()}
    for loss in losses.values():
        check_host_config(
            loss, host="verl", check_length=False, check_tables=False,
            kl_hint="Use verl's own reference-KL loss: actor_rollout_ref.actor.use_kl_loss=true "
                    "with kl_loss_coef and kl_loss_type (or algorithm.use_kl_in_reward).",
            entropy_hint="Use verl's own entropy bonus: actor_rollout_ref.actor.entropy_coeff.")
    names = []
    for name in policy_loss_names():
        verl_name = PREFIX + name
        existing = core.POLICY_LOSS_REGISTRY.get(verl_name)
        if existing is not None and not hasattr(existing, "_nemo_sspo_loss"):
            raise ValueError(f"verl already has a policy loss {verl_name!r} that is not ours")
        core.register_policy_loss(verl_name)(_make_verl_loss(name))
        names.append(verl_name)
    _LOSSES.clear()
    _LOSSES.update(losses)
    return names


def loss_args_from_env() -> dict[str, dict[str, Any]]:
    """``loss_args`` from :data:`LOSS_ARGS_ENV`: JSON ``{"<our loss>": {"<field>": value}}``.

    Returns ``{}`` when the variable is unset or empty.

    Raises:
        ValueError: not valid JSON, or not an object of objects.
    """
    raw = os.environ.get(LOSS_ARGS_ENV, "").strip()
    if not raw:
        return {}
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"{LOSS_ARGS_ENV} is not valid JSON ({error}): {raw!r}") from error
    if not isinstance(args, dict) or not all(isinstance(v, dict) for v in args.values()):
        raise ValueError(f'{LOSS_ARGS_ENV} must be a JSON object {{"loss": {{"field": value}}}}, '
                         f"got {raw!r}")
    return args


def wrap_ppo_loss(ppo_loss):
    """Wrap verl's engine loss ``ppo_loss(config, model_output, data, dp_group=None)``.

    The wrapper reads :data:`SEGMENT_IDS_KEY` and :data:`OLD_ENTROPY_KEY` from the micro-batch
    TensorDict ``data`` (padded like ``old_log_probs``; nested columns are padded first) and calls
    ``ppo_loss`` inside :func:`loss_inputs`. Without those columns it calls ``ppo_loss`` unchanged.
    """
    if hasattr(ppo_loss, "_nemo_sspo_wrapped"):
        return ppo_loss

    @functools.wraps(ppo_loss)
    def ppo_loss_with_sspo_inputs(config, model_output, data, dp_group=None):
        keys = set(data.keys())
        if SEGMENT_IDS_KEY not in keys or OLD_ENTROPY_KEY not in keys:
            return ppo_loss(config, model_output, data, dp_group=dp_group)
        columns = data.select(SEGMENT_IDS_KEY, OLD_ENTROPY_KEY).to_padded_tensor()
        with loss_inputs(segment_ids=columns[SEGMENT_IDS_KEY],
                         old_entropy=columns[OLD_ENTROPY_KEY]):
            return ppo_loss(config, model_output, data, dp_group=dp_group)

    ppo_loss_with_sspo_inputs._nemo_sspo_wrapped = ppo_loss
    return ppo_loss_with_sspo_inputs


def _add_columns(trainer, batch, old_log_prob) -> None:
    """Segment ids of ``batch.responses`` and a copy of the old entropy into ``old_log_prob``."""
    loss_mode = str(trainer.config.actor_rollout_ref.actor.policy_loss.loss_mode)
    if not loss_mode.startswith(PREFIX):
        return
    if "entropys" not in old_log_prob.batch.keys():
        raise RuntimeError(f"verl's old-log-prob pass returned no 'entropys'; {loss_mode!r} needs "
                           "the old policy's entropy")
    name = loss_mode[len(PREFIX):]
    loss = _loss_for(name)
    if getattr(trainer, "_nemo_sspo_tables", None) is None:
        trainer._nemo_sspo_tables = build_segment_tables(trainer.tokenizer)
    mask = batch.batch["response_mask"].bool()
    old_log_prob.batch[SEGMENT_IDS_KEY] = response_segment_ids(
        loss, batch.batch["responses"], mask, trainer._nemo_sspo_tables)
    # verl pops "entropys" after logging it; our copy survives the union into the batch.
    old_log_prob.batch[OLD_ENTROPY_KEY] = old_log_prob.batch["entropys"].clone()


def _patch_trainer(trainer_cls) -> None:
    original = trainer_cls._compute_old_log_prob
    if hasattr(original, "_nemo_sspo_wrapped"):
        return

    @functools.wraps(original)
    def _compute_old_log_prob(self, batch):
        old_log_prob, mfu = original(self, batch)
        _add_columns(self, batch, old_log_prob)
        return old_log_prob, mfu

    _compute_old_log_prob._nemo_sspo_wrapped = original
    trainer_cls._compute_old_log_prob = _compute_old_log_prob


def install(loss_args: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """:func:`register`, then hook verl's trainer and actor loss (module docstring, steps 1-2).

    Idempotent. Needs the full verl install (its trainer and worker modules import Ray, datasets,
    FastAPI, ...). Returns the registered names.

    Raises:
        ImportError: a verl module is missing (says how to install verl).
        AttributeError: verl no longer has ``RayPPOTrainer._compute_old_log_prob`` or
            ``verl.workers.utils.losses.ppo_loss`` (the adapter targets verl 0.9.1).
    """
    names = register(loss_args)
    hint = "install the complete verl release (pip install verl==0.9.1 with its requirements)"
    losses = import_host("verl.workers.utils.losses", "verl's worker losses", hint)
    losses.ppo_loss = wrap_ppo_loss(losses.ppo_loss)
    workers = sys.modules.get("verl.workers.engine_workers")
    if workers is not None:  # it bound `ppo_loss` by name at import
        workers.ppo_loss = wrap_ppo_loss(workers.ppo_loss)
    trainer = import_host("verl.trainer.ppo.ray_trainer", "verl's PPO trainer", hint)
    _patch_trainer(trainer.RayPPOTrainer)
    return names
