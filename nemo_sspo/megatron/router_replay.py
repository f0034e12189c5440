"""Router replay for MoE models: record the experts Megatron's routers choose, or force given ones.

Built on megatron-core 0.16.1's ``transformer/moe/router_replay.py``: with
``moe_enable_routing_replay`` every ``TopKRouter`` owns a ``RouterReplay`` whose action decides its
top-k: ``RECORD`` (compute the top-k, keep the indices), ``REPLAY_FORWARD`` (take the indices set
beforehand and gather their scores, so the routing weights still come from this model's router and
its gradient flows) or none (plain routing). Megatron also keeps every instance in one global
list; the functions here address the routers of one model only (the policy and the reference
model are separate models with separate routers).

Route layout (ours): ``routes [B, S, L, k]`` int16 (int32 past 32768 experts:
:func:`nemo_sspo.algorithms.batch.route_dtype`, the dtype routes are held and sent in; replay widens
them to int64 for Megatron's gather), the k experts chosen for input token ``(b, s)`` in
MoE layer ``l`` of this pipeline stage (local layer order), as Megatron's top-k returns them (in
order of score). Megatron's router sees the tokens sequence-first, flattened: router row
``s * B + b``.

Modes (``model.router_replay``): ``none``; ``r2``: the training forwards reuse the routes of the
old-policy forward; ``r3``: old-policy, reference and training forwards use the routes the rollout
engine chose (``RolloutBatch.routes``, recorded by the transformers engine during ``generate``, in
the same packed input frame as ``PolicyBatch.input_ids``; each pipeline stage takes its layers,
:func:`stage_moe_layers`). Under R3 the trainer can also run one forward with its own routers to
measure how often they agree with the engine's (:func:`engine_routing_sums`).

Packed rows (THD): a packed row's routes are its sequences' routes end to end
(:func:`micro_batch_routes`), so the router of a ``[1, S_in]`` row sees them as it sees the tokens.
Under the TransformerEngine spec the packed row is padded to the THD alignment inside the forward
(``nemo_sspo.megatron.packed_seq.thd_alignment``, e.g. 16 tokens under FP8): the router then sees
the filler tokens too, which replay routes to experts ``0 .. k-1`` and recording drops
(:func:`router_width`).

Sequence parallelism (``parallel.sequence_parallel``): the row is padded to a multiple of TP
(filler tokens as above) and each TP rank's routers see only its ``S' / tp`` positions
(``[S' / tp * B]`` router rows; megatron-core's all-gather dispatcher gathers the tokens over TP x
EP only after the router). Replay gives each rank its positions' slice of the routes
(:func:`~nemo_sspo.megatron.sequence_parallel.sequence_slice`); recording all-gathers the ranks'
slices over TP, so every TP rank holds the whole ``[B, S, L, k]``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from nemo_sspo.algorithms.batch import route_dtype
from nemo_sspo.choice import Choice
from nemo_sspo.megatron.model import unwrap_model, uses_transformer_engine
from nemo_sspo.megatron.moe import is_moe
from nemo_sspo.megatron.packed_seq import padded_width, thd_alignment
from nemo_sspo.megatron.sequence_parallel import gather_sequence, sequence_parallel_size, sequence_slice
from nemo_sspo.metrics import MetricPair

__all__ = [
    "RouterReplay",
    "check_router_replay",
    "clear_routes",
    "engine_routing_sums",
    "expert_load_pair",
    "micro_batch_routes",
    "moe_routers",
    "record_routes",
    "recorded_routes",
    "replay_routes",
    "recording_forward_step",
    "replaying_forward_step",
    "router_width",
    "routing_agreement",
    "stage_moe_layers",
    "write_micro_batch_routes",
]


class RouterReplay(Choice):
    """Router replay modes (``model.router_replay``): no replay, replay the old-policy forward's
    routes, replay the engine's.
    """

    none = "none"
    r2 = "r2"
    r3 = "r3"


def check_router_replay(router_replay: str, hf_config=None) -> None:
    """Checks a router replay mode (and, given the model's HF config, that it has MoE layers).

    Args:
        router_replay: a :class:`RouterReplay` (config key ``model.router_replay``).
        hf_config: the model's HF config, or None to check the mode alone.

    Raises:
        ValueError: naming ``router_replay``: an unknown mode, or replay for a dense model. (Which
            engines and placements ``r3`` works with is the config layer's check.)
    """
    mode = router_replay
    if mode not in tuple(RouterReplay):
        raise ValueError(f"router_replay={mode!r} is unknown; valid: {', '.join(RouterReplay)}")
    if mode != "none" and hf_config is not None and not is_moe(hf_config):
        raise ValueError(f"router_replay={mode!r} needs a mixture-of-experts model; "
                         f"model_type={getattr(hf_config, 'model_type', 'llama')!r} has no router: set it to none")


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
                         "(moe_enable_routing_replay); replay no routes for dense models")
    return [router.router_replay for router in routers]


def stage_moe_layers(model: torch.nn.Module) -> list[int]:
    """0-based global indices of this pipeline stage's MoE layers, in layer order.

    Every decoder layer of a supported MoE model is sparse (``nemo_sspo.megatron.moe``), so they
    index the engine's ``[B, S, L_all, k]`` routes directly.

    Raises:
        ValueError: as :func:`moe_routers`.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    moe_routers(model)
    return [module.layer_number - 1 for module in unwrap_model(model).modules() if isinstance(module, TopKRouter)]


def record_routes(model: torch.nn.Module) -> None:
    """The next forwards of ``model`` record their top-k (read them with :func:`recorded_routes`)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for replay in moe_routers(model):
        replay.clear_indices()
        replay.set_router_replay_action(RouterReplayAction.RECORD)


def recorded_routes(model: torch.nn.Module, batch_size: int, seq_len: int) -> torch.Tensor:
    """``[B, S, L, k]`` routes (dtype :func:`~nemo_sspo.algorithms.batch.route_dtype`) of the last
    recorded forward of a ``[B, S]`` micro-batch (``S``: the width the routers saw,
    :func:`router_width`). Under sequence parallelism each TP rank recorded its ``S / tp``
    positions; they are all-gathered over TP (collective over it) in Megatron's int64.

    Raises:
        ValueError: nothing was recorded, or a layer saw another token count than ``B * S``
            (``B * S / tp`` under sequence parallelism).
    """
    config = unwrap_model(model).config
    local = seq_len // sequence_parallel_size(config)
    layers = []
    for index, replay in enumerate(moe_routers(model)):
        indices = replay.get_recorded_indices()
        if indices is None or indices.shape[0] != batch_size * local:
            seen = None if indices is None else indices.shape[0]
            raise ValueError(f"MoE layer {index} recorded {seen} tokens, expected B * S = "
                             f"{batch_size} * {local}: call record_routes() before the forward")
        routes = gather_sequence(indices.detach().view(local, batch_size, -1).long(), config)
        layers.append(routes.transpose(0, 1))
    return torch.stack(layers, dim=2).to(route_dtype(config.num_moe_experts))


def replay_routes(model: torch.nn.Module, routes: torch.Tensor) -> None:
    """The next forward of ``model`` routes input token ``(b, s)`` of layer ``l`` to ``routes[b, s, l]``.

    Args:
        model: a mixture-of-experts model (this pipeline stage).
        routes: ``[B, S, L, k]`` integer expert ids in ``[0, E)``, L = this stage's MoE layers; the
            forward's micro-batch must be ``[B, S]`` (``S``: the width the routers see,
            :func:`router_width`). Under sequence parallelism each TP rank's routers get their
            positions' slice ``routes[:, r * S / tp : (r + 1) * S / tp]``.

    Raises:
        ValueError: ``routes`` is not 4-D or its layer count is not this stage's, or ``S`` does not
            split over the sequence-parallel ranks.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = moe_routers(model)
    if routes.dim() != 4 or routes.shape[2] != len(replays):
        raise ValueError(f"routes must be [B, S, L={len(replays)}, k], got {tuple(routes.shape)}")
    routes = routes[:, sequence_slice(routes.shape[1], unwrap_model(model).config)]
    batch_size, seq_len = routes.shape[:2]
    for layer, replay in enumerate(replays):
        replay.clear_indices()
        # int64: Megatron gathers the router scores at these indices
        replay.set_target_indices(routes[:, :, layer].transpose(0, 1).reshape(batch_size * seq_len, -1).long())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_routes(model: torch.nn.Module) -> None:
    """Back to plain routing: no action, no recorded or target indices kept."""
    for replay in moe_routers(model):
        replay.clear_indices()
        replay.clear_router_replay_action()


def routing_agreement(routes: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of (token, layer) pairs whose top-k expert sets match (order inside the top-k ignored).

    Args:
        routes: ``[B, S, L, k]`` integer expert ids (e.g. the trainer's routes).
        other: ``[B, S, L, k]`` integer expert ids to compare with (e.g. the engine's routes).
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


def engine_routing_sums(batch, own, *, pp_group, is_last_stage: bool) -> dict[str, MetricPair]:
    """Router replay R3: how the trainer's own routing compares with the engine's, as metric pairs.

    Args:
        batch: the step's rows with the engine's ``routes`` [B, S, L, k] (this stage's layers)
            and ``rollout_logprobs``.
        own: the same rows after a forward with the trainer's own routers
            (``compute_old_logprobs(record_routes=True)`` on ``batch`` without routes): its
            ``routes`` and, on the last stage, ``old_logprobs``.
        pp_group: the pipeline group (each stage holds its own layers' routes; summed over it),
            or None for one stage. Collective over it.
        is_last_stage: whether this rank holds the log-probs.

    Returns:
        ``moe/routing_agreement``: share of (token, MoE layer) pairs whose top-k sets match, over
        the positions whose outputs the loss reads (``loss_mask``: the last prompt token and every
        response token but the last, each of which has an engine route); and, on the last stage,
        ``rollout/trainer_logprob_gap_abs_own_routes``: mean |log pi_rollout - log pi_old| per
        response token with the trainer's own routes (``rollout/trainer_logprob_gap_abs`` is the
        same gap with the engine's routes replayed).
    """
    agreement = routing_agreement(own.routes, batch.routes, batch.loss_mask)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(agreement, group=pp_group)
    sums = {"moe/routing_agreement": MetricPair(agreement[0].float(), agreement[1].float(), "mean")}
    if is_last_stage and batch.loss_mask.any():
        gap = (batch.rollout_logprobs - own.old_logprobs)[batch.loss_mask].abs()
        sums["rollout/trainer_logprob_gap_abs_own_routes"] = MetricPair(gap.sum(), torch.tensor(float(gap.numel())))
    return sums


def _packed_valid(micro) -> torch.Tensor:
    """``[b, S_b]`` bool: the positions of a packed micro-batch's rows that its packed row holds."""
    width = micro.batch.input_ids.shape[1]
    return torch.arange(width)[None, :] < micro.sequence_lengths[:, None]


def micro_batch_routes(micro) -> torch.Tensor:
    """The routes ``[R, S_in, L, k]`` of a micro-batch's model input, from its rows' ``batch.routes``.

    A packed row lays its sequences' routes end to end, as its token ids. An empty micro-batch
    (``nemo_sspo.algorithms.micro_batches.empty_micro_batch``: another micro-batch's input, no row)
    routes every token to experts ``0 .. k-1``: its outputs are never read, but its forward must
    run (the ranks' pass counts must match), and it has no routes of its own.

    Raises:
        ValueError: the micro-batch's batch has no ``routes``.
    """
    routes = micro.batch.routes
    if routes is None:
        raise ValueError("router replay: this micro-batch carries no routes (PolicyBatch.routes is None)")
    if micro.rows.numel() == 0:
        return _filler(micro.input_ids.shape, routes)
    if micro.sequence_lengths is None:
        return routes
    return routes[_packed_valid(micro)][None]


def _filler(shape, like: torch.Tensor) -> torch.Tensor:
    """``[*shape, L, k]`` routes to experts ``0 .. k-1`` (L, k of ``like``) for tokens whose outputs nobody reads."""
    top_k = like.shape[-1]
    return torch.arange(top_k, dtype=like.dtype).expand(*shape, like.shape[2], top_k).contiguous()


def router_width(micro, model: torch.nn.Module) -> int:
    """Tokens per row the routers of ``model`` see for ``micro``'s input, over all TP ranks: its
    width padded as ``nemo_sspo.megatron.model.forward_logits`` pads it (to a multiple of TP under
    sequence parallelism; a packed row under the TransformerEngine spec to the THD alignment).
    """
    width = micro.input_ids.shape[1]
    config = unwrap_model(model).config
    if micro.sequence_lengths is None or not uses_transformer_engine(model):
        return padded_width(width, sequence_parallel_size(config))
    return padded_width(width, thd_alignment(config))


def _router_routes(micro, model: torch.nn.Module) -> torch.Tensor:
    """:func:`micro_batch_routes`, with THD filler tokens up to :func:`router_width`."""
    routes = micro_batch_routes(micro)
    extra = router_width(micro, model) - routes.shape[1]
    if extra == 0:
        return routes
    return torch.cat([routes, _filler((routes.shape[0], extra), routes)], dim=1)


def write_micro_batch_routes(out: torch.Tensor, micro, routes: torch.Tensor) -> None:
    """Writes a micro-batch's recorded routes ``[R, S_in, L, k]`` at its rows of ``out`` ``[B, S, L, k]``.

    The inverse of :func:`micro_batch_routes`; an empty micro-batch writes nothing.
    """
    if micro.rows.numel() == 0:
        return
    if micro.sequence_lengths is not None:
        rows = routes.new_zeros(*micro.batch.input_ids.shape, *routes.shape[2:])
        rows[_packed_valid(micro)] = routes[0]
        routes = rows
    out[micro.rows, : routes.shape[1]] = routes.to(out.device)


def recording_forward_step(forward_step: Callable, recorded: list) -> Callable:
    """``forward_step`` that records each micro-batch's routes.

    Appends ``(micro, routes)`` to ``recorded`` once the micro-batch's forward has run (the routers
    are reset afterwards).
    """

    def step(data_iterator, model):
        micro = next(data_iterator)
        record_routes(model)
        try:
            output = forward_step(iter([micro]), model)
            rows, width = micro.input_ids.shape
            recorded.append((micro, recorded_routes(model, rows, router_width(micro, model))[:, :width]))
        finally:
            clear_routes(model)
        return output

    return step


def replaying_forward_step(forward_step: Callable) -> Callable:
    """``forward_step`` whose forward routes every token to its ``micro.batch.routes`` experts."""

    def step(data_iterator, model):
        micro = next(data_iterator)
        replay_routes(model, _router_routes(micro, model))
        try:
            return forward_step(iter([micro]), model)
        finally:
            clear_routes(model)

    return step


def expert_load_pair(routes: torch.Tensor, lengths: torch.Tensor, num_experts: int, *, dp_group) -> MetricPair:
    """Expert load balance of a step: the most-loaded expert's token count over the mean count.

    Counted per MoE layer over the valid input tokens of every data-parallel rank (one all-reduce
    over ``dp_group``), then the worst layer of this pipeline stage. 1.0 is a perfect balance and
    ``E / k`` means every token went to the same k experts. The formula is ours (a max / mean load
    ratio, as MoE papers report expert load).

    Args:
        routes: ``[B, S, L, k]`` integer routes of this rank's rows (``PolicyBatch.routes``).
        lengths: ``[B]`` int64 valid input tokens per row.
        num_experts: E.
        dp_group: the data-parallel group whose ranks' tokens are counted together.

    Returns:
        A ``"max"`` metric pair (combines across pipeline stages as the worst layer); count 0 when no
        rank has a valid token.
    """
    valid = torch.arange(routes.shape[1])[None, :] < lengths[:, None]
    chosen = routes[valid]  # [N, L, k]
    counts = torch.stack([torch.bincount(chosen[:, layer].reshape(-1), minlength=num_experts)
                          for layer in range(routes.shape[2])]).double()  # [L, E]
    dist.all_reduce(counts, group=dp_group)
    if counts.sum() == 0:
        return MetricPair(torch.zeros(()), torch.zeros(()), "max")
    ratio = counts.max(dim=-1).values / counts.mean(dim=-1)
    return MetricPair(ratio.max().float(), torch.ones(()), "max")
