"""Helpers of the distributed HF <-> Megatron mapping tests: one parallel layout at a time, and a
model's full-vocabulary logits under it."""

from contextlib import contextmanager

import torch
import torch.distributed as dist

from nemo_sspo.megatron import (
    cpu_device_context,
    destroy_parallel,
    forward_logits,
    get_parallel_groups,
    initialize_parallel,
)


WORLD_4_LAYOUTS = ((2, 1), (1, 2), (2, 2))
"""(tp, pp) on world 4, the rest data parallel: TP x DP, PP x DP and TP x PP."""


def check_world_4_layouts(check) -> None:
    """``check(tp, pp, tied)`` for every :data:`WORLD_4_LAYOUTS` layout, with untied and tied embeddings."""
    for tp, pp in WORLD_4_LAYOUTS:
        for tied in (False, True):
            check(tp, pp, tied)


@contextmanager
def megatron_layout(tp: int, pp: int, ep: int = 1, *, seed: int = 7):
    """Megatron's parallel state of a TP x PP (x EP) layout over the spawned world, torn down on
    exit so the next layout can start; yields this rank's parallel groups."""
    initialize_parallel(tp_size=tp, pp_size=pp, seed=seed, ep_size=ep)
    try:
        yield get_parallel_groups()
    finally:
        destroy_parallel()


def full_vocab_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """``[B, S, 128 * tp]`` logits of ``ids`` [B, S] (vocabulary padded as Megatron pads 100 ids) on
    every rank: one micro-batch through the forward-only pipeline schedule, the last stage's shards
    all-gathered over TP and broadcast over PP. Collective over the model-parallel ranks."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    groups = get_parallel_groups()
    collected = []

    def forward_step(data_iterator, stage_model):
        batch = next(data_iterator)
        output = forward_logits(stage_model, batch, torch.arange(batch.shape[1]).expand_as(batch))
        return output, lambda out: (collected.append(out.detach()) or out.sum() * 0.0, {})

    with cpu_device_context(), torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids]), model=[model], num_microbatches=1,
            seq_length=ids.shape[1], micro_batch_size=ids.shape[0], forward_only=True)
    local = collected[0] if groups.is_last_stage else torch.empty(*ids.shape, 128)
    dist.broadcast(local, src=groups.pp_last_rank, group=groups.pp_group)
    shards = [torch.empty_like(local) for _ in range(groups.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=groups.tp_group)
    return torch.cat(shards, dim=-1)
