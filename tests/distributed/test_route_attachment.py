"""Engine routes (router replay R3) stay with their rows through data-parallel balancing, token
budgets and packing, over 2 real gloo ranks.

Each rank holds rows of unequal lengths (rank 0 long, rank 1 short, so balancing moves rows between
ranks) whose token ids and advantage say where they came from, and engine routes drawn from a
generator seeded by that tag. After ``balance_across_data_parallel`` each rank runs the old-policy
forward of the tiny random Qwen3-MoE under a token budget, packed or not; the experts its routers
used (read at the router, ``tests/unit/_route_spy.py``) must be, at every valid token of every row,
the routes drawn for that row's tag. Ranks plan different micro-batch counts here, so the rank
with fewer runs empty micro-batches (the same pass count on every rank), which carry no row and so
no routes: before they got their own, replay and R2's recording failed on them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from nemo_sspo.algorithms.batch import PolicyBatch

LENGTHS = [[14, 12, 11, 9], [3, 3, 2, 2]]  # prompt + response tokens of each rank's rows
EXPERTS, TOP_K, LAYERS = 8, 2, 2


def _routes(tag: int, width: int) -> torch.Tensor:
    """``[width, L, k]`` distinct experts per (token, layer), drawn from ``tag``."""
    generator = torch.Generator().manual_seed(tag)
    return torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K]
                        for _ in range(width * LAYERS)]).view(width, LAYERS, TOP_K)


def _rank_batch(rank: int) -> PolicyBatch:
    lengths = LENGTHS[rank]
    rows, width = len(lengths), max(lengths) + rank
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    tags = [100 * rank + row for row in range(rows)]
    ids = torch.where(valid, torch.tensor(tags)[:, None] + 1, 0)
    targets = torch.cat([ids[:, 1:], torch.zeros(rows, 1, dtype=torch.long)], dim=1)
    loss_mask = valid & (torch.arange(width)[None, :] >= 1)
    loss_mask[torch.arange(rows), torch.tensor(lengths) - 1] = False
    zeros = torch.zeros(rows, width)
    return PolicyBatch(input_ids=ids, position_ids=torch.arange(width).expand(rows, width).contiguous(),
                       targets=targets, loss_mask=loss_mask, segment_ids=torch.where(loss_mask, 0, -1),
                       old_logprobs=zeros, old_entropy=zeros.clone(), advantages=torch.tensor(tags).float(),
                       rollout_logprobs=zeros.clone(), lengths=torch.tensor(lengths),
                       routes=torch.stack([_routes(tag, width) for tag in tags]))


def _replayed(rank, world_size):
    torch.set_num_threads(1)
    from nemo_sspo.algorithms.losses import GRPOLossConfig, make_policy_loss
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, get_parallel_groups,
                                    initialize_parallel, load_hf_into_megatron)
    from nemo_sspo.megatron.training import compute_old_logprobs, forward_logprobs
    from nemo_sspo.models import load_hf_checkpoint
    from nemo_sspo.parallel.data_balance import balance_across_data_parallel
    from nemo_sspo.megatron.step import LossSpec
    from tests.unit._route_spy import spy_routes

    initialize_parallel(tp_size=1, pp_size=1, seed=0)
    try:
        config, state_dict, _ = load_hf_checkpoint("tiny-random-qwen3-moe")
        model = build_policy_model(config)
        load_hf_into_megatron(model, state_dict, config)
        spec = LossSpec(loss=make_policy_loss("grpo", GRPOLossConfig(aggregation="token-mean")), tp_group=None,
                        vocab_start=0, vocab_size=config.vocab_size, temperature=1.0, max_response_length=16,
                        output_chunk_size=None)
        dp_group = get_parallel_groups().dp_group
        batch = balance_across_data_parallel(_rank_batch(rank), dp_group)
        out = {}
        for name, layout in (("token-budget", MicroBatchLayout(max_tokens=24)),
                             ("packed", MicroBatchLayout(max_tokens=24, pack=True))):
            _, used = spy_routes(lambda layout=layout: forward_logprobs(model, batch, spec, layout, dp_group=dp_group),
                                 batch)
            out[name] = used
        # R2's recording side over the same layouts: what it keeps is what the routers chose
        own, chosen = spy_routes(lambda: compute_old_logprobs(model, replace(batch, routes=None), spec,
                                                              MicroBatchLayout(max_tokens=24), dp_group=dp_group,
                                                              record_routes=True), batch)
        return batch.advantages.long().tolist(), batch.row_lengths().tolist(), out, (own.routes, chosen)
    finally:
        destroy_parallel()


def test_replayed_routes_of_every_row_are_its_engine_routes_after_balancing(run_distributed):
    results = run_distributed(_replayed, 2)
    moved = 0
    for rank, (tags, lengths, used, (recorded, chosen)) in enumerate(results):
        moved += sum(tag // 100 != rank for tag in tags)
        for row, (tag, length) in enumerate(zip(tags, lengths, strict=True)):
            expected = _routes(tag, length)
            for name, routes in used.items():
                assert torch.equal(routes[row, :length], expected), (rank, tag, name)
            assert torch.equal(recorded[row, :length], chosen[row, :length]), (rank, tag)
    assert moved == 4  # balancing moved rows both ways: 2 long rows to rank 1, 2 short ones to rank 0
