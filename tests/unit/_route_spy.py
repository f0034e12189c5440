"""Which experts Megatron's routers used in a pass, read at the router.

A spy on megatron-core's ``RouterReplay.get_replay_topk`` (it returns the indices the dispatcher
gets, replayed or computed) and on the trainer's forward step (to know each micro-batch). The
router sees an ``[R, S_in]`` input sequence-first: its row ``s * R + r`` is token ``(r, s)``, undone
here independently of ``nemo_sspo.megatron.router_replay``; packed rows are written back at their
sequences' rows by ``write_micro_batch_routes`` (checked against transformers in
tests/unit/megatron/test_router_replay.py).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

from nemo_sspo.megatron import training
from nemo_sspo.megatron.router_replay import write_micro_batch_routes


def spy_routes(run, batch):
    """``(run(), routes [B, S, L, k])``: the experts every router used for each valid token of ``batch``."""
    calls, used = [], []
    real_topk, real_step = RouterReplay.get_replay_topk, training.policy_forward_step

    def topk(self, *args, **kwargs):
        probs, indices = real_topk(self, *args, **kwargs)
        calls.append(indices.detach().clone())
        return probs, indices

    def forward_step(*args, **kwargs):
        inner = real_step(*args, **kwargs)

        def step(data_iterator, model):
            micro = next(data_iterator)
            calls.clear()
            out = inner(iter([micro]), model)
            rows, width = micro.input_ids.shape
            used.append((micro, torch.stack([c.view(width, rows, -1).transpose(0, 1) for c in calls], dim=2)))
            return out

        return step

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RouterReplay, "get_replay_topk", topk)
        patch.setattr(training, "policy_forward_step", forward_step)
        result = run()
    routes = torch.zeros(*batch.input_ids.shape, *used[0][1].shape[2:], dtype=torch.long)
    for micro, micro_routes in used:
        if micro.rows.numel():  # an empty (padding) micro-batch holds no row
            write_micro_batch_routes(routes, micro, micro_routes)
    return result, routes
