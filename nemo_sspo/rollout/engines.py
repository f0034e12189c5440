"""The rollout-engine interface the trainer uses, and the name -> builder registry behind
``rollout.engine.backend``.

An engine generates seeded samples for rendered prompts and takes refitted weights in buckets
(:class:`RolloutEngine`). It is registered as a builder that receives an :class:`EngineContext`
(the initial HF checkpoint, the tokenizer and the ``rollout`` section), so the trainer holds no
per-engine branch: ``hf`` (transformers ``generate``) and ``vllm`` are registered here, and a user
module registers its own and is named by the config key ``plugins``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from nemo_sspo.models import build_hf_model
from nemo_sspo.models.hf_checkpoint import engine_model_dir
from nemo_sspo.registry import BuilderRegistry
from nemo_sspo.rollout.hf_engine import HFRolloutEngine, RolloutBatch
from nemo_sspo.rollout.vllm_engine import VLLMOptions, VLLMRolloutEngine, serves_adapters

__all__ = ["ROLLOUT_ENGINE_REGISTRY", "EngineContext", "RolloutEngine", "build_rollout_engine",
           "register_rollout_engine", "rollout_engine_names", "unregister_rollout_engine"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer calls on its rollout engine.

    Attributes:
        stop_token_ids: the ids that end a response (also written to saved checkpoints).

    An engine may also define ``read_weights(names: list[str]) -> dict[str, torch.Tensor] | None``,
    which ``rollout.refit.verify`` needs (``nemo_sspo.rollout.refit_check``; not a member of this
    protocol, so engines without it stay valid): the weights it holds now under the refit buckets'
    HF names (every name it holds; names it lacks left out), each tensor in the dtype the engine
    computes with and exactly as loaded (its own tensor or a view; a copy is allowed but costs
    memory), or None when it cannot read them back exactly. A fake engine that keeps the buckets it
    loaded returns those tensors; one that changes what it loads must return what it holds, not
    what it was sent. ``HFRolloutEngine`` returns its parameters; ``VLLMRolloutEngine`` returns None.
    """

    stop_token_ids: list[int]

    def generate(self, prompts: list[str], *, seed: int) -> RolloutBatch:
        """One sampled response per rendered prompt; the same seed, prompts and weights give the
        same responses, and the global RNGs are left as they were.
        """
        ...

    def load_weight_buckets(self, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        """Refit: HF-named weight buckets of the updated policy.

        ``buckets`` is a one-shot iterator (a generator that gathers or receives one bucket at a
        time): iterate it once and to the end, since other ranks' collectives advance with it, and
        copy each bucket into the engine without keeping it (a received bucket's tensors are views
        of its whole receive buffer: kept buckets add up to a second copy of the model).
        """
        ...

    def sleep(self) -> None:
        """Free the engine's memory between generation and refit (a no-op where it does not apply)."""
        ...

    def wake_up(self) -> None:
        """Undo :meth:`sleep` (a no-op where it does not apply)."""
        ...

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The engine's current weights under HF names, or None when they cannot be read back
        (then a failed run keeps no ``hf_checkpoint_interrupted``).
        """
        ...

    def shutdown(self) -> None:
        """Release the engine once the trainer runs no more collectives, before its process groups
        end (an in-process vLLM tears down torch.distributed); a no-op where it does not apply.
        """
        ...


@dataclass(frozen=True)
class EngineContext:
    """What an engine builder may use.

    Attributes:
        hf_config: the policy's Hugging Face config.
        state_dict: the initial policy weights under HF names (not to be modified).
        tokenizer: the policy's tokenizer.
        model_source: ``model.source`` (a built-in name, a model folder or a hub id).
        cache_dir: ``model.cache_dir``.
        rollout: the ``rollout`` config section (``sampling``, ``engine``, ``correction``). The engine's
            own settings are ``rollout.engine.options``: an instance of the options dataclass it was
            registered with (``register_rollout_engine(name, build, options=MyOptions)``; ``vllm``:
            :class:`~nemo_sspo.rollout.vllm_engine.VLLMOptions`), selected as the group
            ``rollout/engine=<name>`` and set as ``rollout.engine.options.<field>=...``; for an engine
            registered without one, a mapping of its own keys (given whole) or None.
        seed: ``trainer.seed``.
        device: the training device (the trainer's CUDA device, or the CPU).
        stop_ids: the model's stop list (``nemo_sspo.models.hf_folder.stop_token_ids``), the one
            the trainer also writes into every model folder.
        record_routes: the trainer replays the engine's MoE routes (``model.router_replay=r3``):
            the engine must return them as ``RolloutBatch.routes``.
        output_layer_precision: ``model.output_layer_precision`` (``auto``, ``bf16``, ``tf32``, ``fp32``): the
            precision the engine's output layer should compute logits in, as the trainer's does.
        adapter_rank: the rank of the LoRA adapters every refit brings instead of weights
            (``model.lora.refit=adapters``: ``nemo_sspo.megatron.AdapterExporter``'s buckets, to apply at
            scale 1 on the initial weights); 0: refits bring weights.
    """

    hf_config: Any
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    model_source: str
    cache_dir: str | None
    rollout: Any
    seed: int
    device: torch.device
    stop_ids: list[int]
    record_routes: bool
    output_layer_precision: str
    adapter_rank: int = 0


ROLLOUT_ENGINE_REGISTRY: BuilderRegistry[EngineContext, RolloutEngine] = BuilderRegistry(
    "rollout engine", key="backend")
"""``rollout.engine.backend`` -> builder ``build(context) -> RolloutEngine``.

The public functions below are its methods, so the rules and messages are the registry's
(:mod:`nemo_sspo.registry`):

- ``register_rollout_engine(name, build, options=None) -> build``: ``rollout.engine.backend=<name>``
  builds with ``build``; ``options``, a dataclass, is the schema of ``rollout.engine.options`` (the
  group ``rollout/engine=<name>`` selects it with its defaults; None: an untyped mapping or None).
  ``ValueError`` if the name is taken, ``TypeError`` if ``options`` is not a dataclass type.
- ``unregister_rollout_engine(name) -> build``: removes it (tests and plug-ins that register
  temporarily); ``ValueError`` for an unknown name.
- ``rollout_engine_names() -> list[str]``: the sorted registered names.
- ``build_rollout_engine(name, context) -> RolloutEngine``: the engine built from ``context``;
  ``ValueError`` for an unknown name (listing the registered ones) or from the builder's checks.
"""

register_rollout_engine = ROLLOUT_ENGINE_REGISTRY.add
unregister_rollout_engine = ROLLOUT_ENGINE_REGISTRY.remove
rollout_engine_names = ROLLOUT_ENGINE_REGISTRY.names
build_rollout_engine = ROLLOUT_ENGINE_REGISTRY.build


def sampling_settings(rollout: Any) -> dict[str, Any]:
    """The engines' sampling keyword arguments from the ``rollout`` section (its ``sampling``)."""
    sampling = rollout.sampling
    return dict(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p)


def _build_hf(context: EngineContext) -> HFRolloutEngine:
    """A transformers copy of the policy on the training device, stopping at the model's list.

    Raises:
        ValueError: ``context.adapter_rank`` set (this engine takes weights only).
    """
    if context.adapter_rank:
        raise ValueError("the hf engine takes refitted weights only, not adapters; refit merged weights")
    return HFRolloutEngine(build_hf_model(context.hf_config, context.state_dict), context.tokenizer,
                           device=context.device, stop_token_ids=context.stop_ids,
                           record_routes=context.record_routes, output_layer_precision=context.output_layer_precision,
                           **sampling_settings(context.rollout))


def _build_vllm(context: EngineContext) -> VLLMRolloutEngine:
    """A vLLM engine loading the model folder itself (``engine_model_dir``).

    Raises:
        ValueError: ``context.adapter_rank`` set for a mixture-of-experts model on a host without CUDA
            (with LoRA enabled vLLM runs the experts through Triton kernels, which its CPU build cannot run).
    """
    if context.adapter_rank and not serves_adapters(context.hf_config):
        raise ValueError(f"adapter_rank={context.adapter_rank}: vLLM's CPU build cannot serve LoRA adapters on a "
                         "mixture-of-experts model (with LoRA enabled it runs the experts through Triton GPU "
                         "kernels); refit merged weights on this host")
    model_dir = engine_model_dir(context.model_source, cache_dir=context.cache_dir)
    ro = context.rollout
    return VLLMRolloutEngine.build(model_dir, context.tokenizer, options=ro.engine.options, seed=context.seed,
                                   truncation_corrected=ro.correction.name != "none",
                                   stop_token_ids=context.stop_ids, output_layer_precision=context.output_layer_precision,
                                   adapter_rank=context.adapter_rank, **sampling_settings(ro))


register_rollout_engine("hf", _build_hf)
register_rollout_engine("vllm", _build_vllm, options=VLLMOptions)
