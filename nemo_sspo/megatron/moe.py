"""Qwen3-MoE on Megatron-Core: the router / expert settings and their checks.

HF ``Qwen3MoeSparseMoeBlock`` (transformers 5.24) routes each token as follows: router logits
``z = W_r x`` ([E] per token, W_r = ``mlp.gate.weight`` [E, H]), probabilities ``p = softmax(z)``
in fp32, the top-k experts by ``p``, and weights ``p_topk`` (``norm_topk_prob=False``) or
``p_topk / sum(p_topk)`` (``norm_topk_prob=True``). The block returns
``sum_k w_k * expert_k(x)`` with SwiGLU experts of width ``moe_intermediate_size``; there is no
shared expert. Megatron's ``TopKRouter`` with the softmax score function gives the same weights:

- ``moe_router_pre_softmax=True``: softmax over all E logits, then top-k = ``norm_topk_prob=False``;
- ``moe_router_pre_softmax=False``: top-k logits, then softmax over those k. Since
  ``softmax(z)_i / sum_{j in topk} softmax(z)_j = exp(z_i) / sum_{j in topk} exp(z_j)``, this is
  ``norm_topk_prob=True``.

Tokens reach the experts through Megatron's ``allgather`` token dispatcher (all-gather and
reduce-scatter over the expert-tensor-and-model-parallel group), which runs over gloo on CPU;
its ``alltoall`` dispatcher creates a CUDA stream at construction. Megatron's all-gather assumes
every rank of that group holds as many tokens as the others, which RL micro-batches (padded to
their own longest row, token budgets, packing) do not: :func:`even_token_dispatch` gives each MoE
layer a dispatcher that pads the token rows to the group's largest count with rows routed to no
expert, and drops them again after the combine.

Expert parallelism (EP, ``parallel.expert_model_parallel_size``): EP rank ``r`` holds experts
``[r*E/EP, (r+1)*E/EP)`` of every MoE layer as ``mlp.experts.local_experts.{i}`` (global expert
``r*E/EP + i``). Expert weights are split over TP as the dense MLP (expert tensor parallel size =
TP, Megatron's default); training under TP > 1 needs sequence parallelism (megatron-core's MoE
layer refuses it otherwise): each TP rank then routes its own positions, and the dispatcher gathers
the tokens over TP x EP. The EP ranks are carved out of the data-parallel ranks (Megatron's
tp-cp-ep-dp-pp order): with TP x PP = 1 and world 2, EP 2 means two data-parallel replicas whose
tokens meet in the experts.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

__all__ = [
    "MOE_MODEL_TYPES",
    "even_token_dispatch",
    "global_expert",
    "is_moe",
    "moe_config_kwargs",
    "num_experts",
    "recording_router_logits",
    "validate_moe",
]

MOE_MODEL_TYPES = ("qwen3_moe",)
"""HF ``model_type`` values with sparse (mixture-of-experts) MLP layers."""


def is_moe(hf_config: Any) -> bool:
    """True for a mixture-of-experts config (``model_type`` in :data:`MOE_MODEL_TYPES`)."""
    return getattr(hf_config, "model_type", None) in MOE_MODEL_TYPES


def num_experts(hf_config: Any) -> int:
    """``num_experts`` of a Qwen3-MoE config (transformers 5 also calls it ``num_local_experts``)."""
    return int(getattr(hf_config, "num_experts", None) or hf_config.num_local_experts)


def validate_moe(hf_config: Any, ep_size: int, *, ep_name: str = "ep_size") -> None:
    """Refuses MoE configs the mapping does not cover, or an EP size that does not split the experts.

    Args:
        hf_config: a HF config; dense configs pass only with ``ep_size == 1``.
        ep_size: expert-model-parallel size (``parallel.expert_model_parallel_size``).
        ep_name: the name of ``ep_size`` in messages (the caller's argument or config key).

    Raises:
        ValueError: naming the field: ``ep_size > 1`` for a dense model; ``decoder_sparse_step != 1``
            or a non-empty ``mlp_only_layers`` (dense MLP layers between sparse ones); a top-k
            outside ``[1, num_experts]``; ``num_experts`` not divisible by ``ep_size``.
    """
    if not is_moe(hf_config):
        if ep_size != 1:
            raise ValueError(f"{ep_name}={ep_size} needs a mixture-of-experts "
                             f"model (one of {', '.join(MOE_MODEL_TYPES)}); set it to 1 for "
                             f"model_type={getattr(hf_config, 'model_type', 'llama')!r}")
        return
    step = getattr(hf_config, "decoder_sparse_step", 1)
    dense_layers = list(getattr(hf_config, "mlp_only_layers", None) or [])
    if step != 1 or dense_layers:
        raise ValueError(f"hf_config.decoder_sparse_step={step} / mlp_only_layers={dense_layers} is not "
                         "supported: every layer must be sparse (decoder_sparse_step=1, mlp_only_layers=[])")
    experts, top_k = num_experts(hf_config), int(hf_config.num_experts_per_tok)
    if not 1 <= top_k <= experts:
        raise ValueError(f"hf_config.num_experts_per_tok={top_k} must lie in [1, num_experts={experts}]")
    if experts % ep_size:
        raise ValueError(f"hf_config.num_experts={experts} is not divisible by "
                         f"{ep_name}={ep_size}: choose a size dividing it")


def moe_config_kwargs(hf_config: Any, ep_size: int) -> dict[str, Any]:
    """``TransformerConfig`` fields of a Qwen3-MoE config (empty for a dense config).

    The router weights are HF's (see the module docstring for the ``norm_topk_prob`` equivalence);
    the router runs in fp32 as HF's softmax. Megatron's own auxiliary load-balancing loss is off
    (``moe_router_load_balancing_type="none"``): it normalises per layer and by k, HF pools all
    layers (:mod:`nemo_sspo.algorithms.load_balancing`); HF's loss is added by the policy loss
    instead when ``model.router_aux_loss_coef > 0`` (:func:`recording_router_logits`). Every router
    can record or replay its top-k (:mod:`nemo_sspo.megatron.router_replay`); until asked to, it
    routes as usual.

    Raises:
        ValueError: as :func:`validate_moe`.
    """
    validate_moe(hf_config, ep_size)
    if not is_moe(hf_config):
        return {}
    return dict(
        num_moe_experts=num_experts(hf_config),
        moe_router_topk=int(hf_config.num_experts_per_tok),
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(hf_config.norm_topk_prob),
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=None,
        expert_model_parallel_size=ep_size,
        moe_enable_routing_replay=True,  # routers get a RouterReplay (plain routing until told)
    )


@contextmanager
def recording_router_logits(model: torch.nn.Module) -> Iterator[list]:
    """Records every MoE router's logits and routing map during the forwards run inside the block.

    A forward hook on each ``TopKRouter`` recomputes the router logits from the router's input with
    the router's own ``gating`` (fp32, the same linear layer, so the gradient reaches the router
    weight and the hidden states) and keeps the ``[N, E]`` bool routing map the router returned
    (the experts the tokens went to, replayed ones included). Costs one extra ``[N, H] x [H, E]``
    product per layer.

    Under sequence parallelism each TP rank's router sees its ``S / tp`` positions only; both
    tensors are all-gathered over TP (:func:`nemo_sspo.megatron.sequence_parallel.gather_sequence`,
    backward: this rank's rows, as the loss built from them is the same on every TP rank), so
    every rank records the whole micro-batch.

    Yields:
        A list that receives ``(logits [N, E] float32, routing_map [N, E] bool)`` per MoE layer, in
        the order the layers ran; N = the micro-batch's tokens (its padded width times its rows),
        sequence-first (row ``s * B + b``).
    """
    from megatron.core.transformer.moe.router import TopKRouter

    from nemo_sspo.megatron.sequence_parallel import gather_sequence

    records: list = []

    def hook(router, args, kwargs, output):
        hidden = args[0] if args else kwargs["input"]
        logits = router.gating(hidden)
        experts = logits.shape[-1]
        records.append((gather_sequence(logits.reshape(-1, experts), router.config),
                        gather_sequence(output[1].reshape(-1, experts), router.config)))

    handles = [module.register_forward_hook(hook, with_kwargs=True)
               for module in model.modules() if isinstance(module, TopKRouter)]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def global_expert(local_index: int, ep_rank: int, local_experts: int) -> int:
    """Global expert id of this EP rank's ``local_experts.{local_index}`` (contiguous blocks)."""
    return ep_rank * local_experts + local_index


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` [N, ...] with ``rows - N`` zero (False) rows appended."""
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


@functools.cache
def _even_dispatcher_class():
    """Megatron's all-gather dispatcher, padded to equal token counts over its TP x EP group."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class EvenTokenAllGatherDispatcher(MoEAllGatherTokenDispatcher):
        """Pads this rank's tokens to the TP x EP group's largest count before the all-gather.

        A padded row carries zero hidden state, zero probabilities and an all-False routing map,
        so no expert sees it and the combine gives it zeros; ``token_combine`` cuts the rows back
        to this rank's count. One scalar all-reduce (max) per layer and forward.
        """

        def token_dispatch(self, hidden_states, probs):
            self.local_tokens = hidden_states.shape[0]
            if self.tp_size > 1 or self.ep_size > 1:
                most = torch.tensor([self.local_tokens], device=hidden_states.device)
                dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.tp_ep_group)
                rows = int(most)
                if rows > self.local_tokens:
                    hidden_states, probs = _pad_rows(hidden_states, rows), _pad_rows(probs, rows)
                    self.routing_map = _pad_rows(self.routing_map, rows)
            return super().token_dispatch(hidden_states, probs)

        def token_combine(self, hidden_states):
            return super().token_combine(hidden_states)[: self.local_tokens]

    return EvenTokenAllGatherDispatcher


def even_token_dispatch(model: torch.nn.Module) -> int:
    """Gives every MoE layer of ``model`` the padded all-gather dispatcher (module docstring).

    Returns the number of layers changed (0 for a dense model). The dispatcher's class is switched in place to a subclass that only overrides
    ``token_dispatch`` / ``token_combine``, so the state Megatron set up (groups, expert indices)
    is kept as is.
    """
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    even = _even_dispatcher_class()
    changed = 0
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if type(dispatcher) is MoEAllGatherTokenDispatcher:
            dispatcher.__class__ = even
            changed += 1
    return changed
