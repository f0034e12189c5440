"""Router replay for MoE models: record the experts Megatron's routers choose, or force given ones.

Built on megatron-core 0.16.1's ``transformer/moe/router_replay.py``: with
``moe_enable_routing_replay`` every ``TopKRouter`` owns a ``RouterReplay`` whose action decides its
top-k: ``RECORD`` (compute the top-k, keep the indices), ``REPLAY_FORWARD`` (take the indices set
beforehand and gather their scores, so the routing weights still come from this model's router and
its gradient flows) or none (plain routing). Megatron also keeps every instance in one global
list; the functions here address the routers of one model only (the policy and the reference
model are separate models with separate routers).

Route layout (ours): ``routes [B, S, L, k]`` int64, the k experts chosen for input token ``(b, s)`` in
MoE layer ``l`` of this pipeline stage (local layer order), as Megatron's top-k returns them (in
order of score). Megatron's router sees the tokens sequence-first, flattened: router row
``s * B + b``.

Modes (``model.router_replay``): ``none``; ``r2``: the training forwards reuse the routes of the
old-policy forward; ``r3``: old-policy, reference and training forwards use the routes the rollout
engine chose.
"""

from __future__ import annotations

import torch

from nemo_sspo.megatron.model import unwrap_model

__all__ = [
    "ROUTER_REPLAY_MODES",
    "clear_routes",
    "moe_routers",
    "record_routes",
    "recorded_routes",
    "replay_routes",
    "routing_agreement",
]

ROUTER_REPLAY_MODES = ("none", "r2", "r3")
"""``model.router_replay`` values: no replay, replay the old-policy forward's routes, replay the engine's."""


def moe_routers(model: torch.nn.Module) -> list:
    """The ``RouterReplay`` of every MoE layer of this stage of ``model``, in layer order.

    Raises:
        ValueError: ``model`` has MoE layers without replay support (built without
            ``moe_enable_routing_replay``), or no MoE layer at all.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [module for module in unwrap_model(model).modules() if isinstance(module, TopKRouter)]
    if not routers or any(router.router_replay is None for router in routers):
        raise ValueError("router replay needs a mixture-of-experts model built by build_policy_model "
                         "(moe_enable_routing_replay); set model.router_replay=none for dense models")
    return [router.router_replay for router in routers]


def record_routes(model: torch.nn.Module) -> None:
    """The next forwards of ``model`` record their top-k (read them with :func:`recorded_routes`)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for replay in moe_routers(model):
        replay.clear_indices()
        replay.set_router_replay_action(RouterReplayAction.RECORD)


def recorded_routes(model: torch.nn.Module, batch_size: int, seq_len: int) -> torch.Tensor:
    """``[B, S, L, k]`` int64 routes of the last recorded forward of a ``[B, S]`` micro-batch.

    Raises:
        ValueError: nothing was recorded, or a layer saw another token count than ``B * S``.
    """
    layers = []
    for index, replay in enumerate(moe_routers(model)):
        indices = replay.get_recorded_indices()
        if indices is None or indices.shape[0] != batch_size * seq_len:
            seen = None if indices is None else indices.shape[0]
            raise ValueError(f"MoE layer {index} recorded {seen} tokens, expected B * S = "
                             f"{batch_size} * {seq_len}: call record_routes() before the forward")
        layers.append(indices.detach().view(seq_len, batch_size, -1).transpose(0, 1))
    return torch.stack(layers, dim=2).long()


def replay_routes(model: torch.nn.Module, routes: torch.Tensor) -> None:
    """The next forward of ``model`` routes input token ``(b, s)`` of layer ``l`` to ``routes[b, s, l]``.

    Args:
        model: a mixture-of-experts model (this pipeline stage).
        routes: ``[B, S, L, k]`` int64 expert ids in ``[0, E)``, L = this stage's MoE layers; the
            forward's micro-batch must be ``[B, S]``.

    Raises:
        ValueError: ``routes`` is not 4-D or its layer count is not this stage's.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = moe_routers(model)
    if routes.dim() != 4 or routes.shape[2] != len(replays):
        raise ValueError(f"routes must be [B, S, L={len(replays)}, k], got {tuple(routes.shape)}")
    batch_size, seq_len = routes.shape[:2]
    for layer, replay in enumerate(replays):
        replay.clear_indices()
        replay.set_target_indices(routes[:, :, layer].transpose(0, 1).reshape(batch_size * seq_len, -1))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_routes(model: torch.nn.Module) -> None:
    """Back to plain routing: no action, no recorded or target indices kept."""
    for replay in moe_routers(model):
        replay.clear_indices()
        replay.clear_router_replay_action()


def routing_agreement(routes: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of (token, layer) pairs whose top-k expert sets match (order inside the top-k ignored).

    Args:
        routes, other: ``[B, S, L, k]`` int64 expert ids (e.g. trainer and engine routes).
        mask: ``[B, S]`` bool, the tokens to count (e.g. response tokens).

    Returns:
        ``[2]`` float64: (matching pairs, counted pairs), to be summed over ranks before dividing.

    Raises:
        ValueError: shapes that differ, or a mask that is not ``[B, S]``.
    """
    if routes.shape != other.shape or mask.shape != routes.shape[:2]:
        raise ValueError(f"routes {tuple(routes.shape)}, other {tuple(other.shape)} and mask "
                         f"{tuple(mask.shape)} must be [B, S, L, k], [B, S, L, k] and [B, S]")
    same = (routes.sort(dim=-1).values == other.sort(dim=-1).values).all(dim=-1)  # [B, S, L]
    counted = mask[..., None].expand_as(same)
    return torch.stack([(same & counted).sum(), counted.sum()]).double()
