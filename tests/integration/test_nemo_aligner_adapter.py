"""NeMo-Aligner adapter called as NeMo-Aligner's Megatron actor calls its ``loss_func``.

The full NeMo-Aligner actor cannot run here (it needs NeMo 2.x-era containers: NeMo toolkit NLP
collection, Apex, TransformerEngine); its own loss_func was recorded instead
(test_nemo_aligner_recorded.py). This file reproduces its calling convention under parallelism: the actor batch keys in its
layout ([B, S - 1] target-frame tensors, ``is_end``), ``loss_func(parallel_logits)`` per
micro-batch on vocab-sharded logits, Megatron's schedule averaging the micro-batch losses, DDP
averaging gradients over data-parallel ranks, and metrics reduced over the data-parallel group.
Two gloo processes run two phases: tensor parallelism 2 (one data-parallel rank) and data
parallelism 2 (full vocabulary per rank).

Reference: our native loss per micro-batch on the float64 full-vocabulary logits (the host's
objective is the mean of per-micro-batch losses). Tolerance: float64, summation order only:
rtol 1e-9; metrics are float32 pairs: rtol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_sspo.algorithms.losses import get_policy_loss
from tests.integration import _host_batches as hb

MICRO = 2  # rows per micro-batch
RTOL, ATOL = 1e-9, 1e-12
_FIELDS = {"alpha": 0.1, "gamma": 2.2}  # SSPO, paper's 7B setting


def _actor_batch(batch, rows) -> dict[str, torch.Tensor]:
    mask = batch["mask"][rows]
    is_end = torch.ones(mask.shape[0])
    if rows.start <= 3 < rows.stop:
        is_end[3 - rows.start] = 0.0  # a truncated response: the actor drops it from the loss
    return {"response_tokens": batch["ids"][rows], "mask": mask.float(),
            "advantages": batch["advantages"][rows, None] * mask,
            "prev_logprobs": batch["old_logprobs"][rows], "prev_entropy": batch["old_entropy"][rows],
            "is_end": is_end}


def _host_step(batch, rows, shard, **kwargs):
    """The actor's training step on ``rows``: loss_func per micro-batch, schedule averages."""
    from nemo_sspo.integrations.nemo_aligner import make_actor_loss_func

    config = get_policy_loss("sspo").config_cls(**_FIELDS)
    losses, metrics = [], []
    for start in range(0, rows.stop - rows.start, MICRO):
        micro = slice(rows.start + start, rows.start + start + MICRO)
        loss_func = make_actor_loss_func(_actor_batch(batch, micro), loss_config=config,
                                         tables=hb.tables(), vocab_size=hb.VOCAB,
                                         old_entropy_source="batch", **kwargs)
        loss, reduced = loss_func(shard[start:start + MICRO])
        losses.append(loss)
        metrics.append({k: float(v) for k, v in reduced.items()})
    total = torch.stack(losses).mean()  # Megatron's schedule divides by num_microbatches
    total.backward()
    return float(total.detach()), shard.grad, metrics


def _worker(rank, world_size):
    from nemo_sspo.integrations.nemo_aligner import logprobs_and_entropy

    batch = hb.global_batch(3)
    group = dist.group.WORLD
    half = hb.VOCAB_PADDED // 2
    # Phase A: tensor parallelism 2, one data-parallel rank holding the whole batch.
    columns = slice(rank * half, (rank + 1) * half)
    shard = batch["logits"][:, :, columns].clone().requires_grad_(True)
    tp = _host_step(batch, slice(0, hb.ROWS), shard, tp_group=group, dp_group=None)
    helper = logprobs_and_entropy(batch["logits"][:, :, columns], batch["ids"], tp_group=group,
                                  vocab_size=hb.VOCAB)
    # Phase B: data parallelism 2, full vocabulary on each rank.
    rows = slice(rank * hb.ROWS // 2, (rank + 1) * hb.ROWS // 2)
    full = batch["logits"][rows].clone().requires_grad_(True)
    dp = _host_step(batch, rows, full, tp_group=None, dp_group=group)
    return {"tp": tp, "dp": dp, "helper": helper}


def _reference(batch):
    """Per micro-batch native losses and metrics, and the gradient of their mean."""
    config = get_policy_loss("sspo").config_cls(**_FIELDS)
    logits = batch["logits"].clone().requires_grad_(True)
    sub = dict(batch, logits=logits)
    losses, metrics = [], []
    for start in range(0, hb.ROWS, MICRO):
        rows = slice(start, start + MICRO)
        actor = _actor_batch(batch, rows)
        mask = actor["mask"].bool() & actor["is_end"].bool()[:, None]
        num, den, _, pairs = hb.native_loss("sspo", config, sub, rows, mask)
        losses.append(num / den)
        metrics.append(pairs)
    torch.stack(losses).mean().backward()
    return [float(x.detach()) for x in losses], metrics, logits.grad


def _ratio(pairs, key):
    total = sum(float(p[key].total) for p in pairs)
    return total / sum(float(p[key].count) for p in pairs)


def test_actor_loss_func_under_tp2_and_dp2(run_distributed):
    results = run_distributed(_worker, 2)
    batch = hb.global_batch(3)
    ref_losses, ref_metrics, ref_grad = _reference(batch)
    key = "policy/clipfrac_tokens"
    half, per_rank = hb.VOCAB_PADDED // 2, hb.ROWS // 2
    assert 0 < _ratio(ref_metrics, key) < 1  # the inputs clip some tokens, not all

    # Phase A (TP 2): both ranks see the host's objective and their vocabulary slice of its grad.
    for rank, result in enumerate(results):
        total, grad, metrics = result["tp"]
        assert total == pytest.approx(sum(ref_losses) / len(ref_losses), rel=RTOL)
        torch.testing.assert_close(grad, ref_grad[:, :, rank * half:(rank + 1) * half],
                                   rtol=RTOL, atol=ATOL)
        for mb, values in enumerate(metrics):
            assert values["loss"] == pytest.approx(ref_losses[mb], rel=1e-6)
            assert values[key] == pytest.approx(_ratio([ref_metrics[mb]], key), rel=1e-6)

    # Phase B (DP 2): DDP averages the ranks' gradients; metrics are reduced over the DP group.
    totals = [result["dp"][0] for result in results]
    assert sum(totals) / 2 == pytest.approx(sum(ref_losses) / len(ref_losses), rel=RTOL)
    for rank, result in enumerate(results):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        torch.testing.assert_close(result["dp"][1] / 2, ref_grad[rows], rtol=RTOL, atol=ATOL)
    micro_per_rank = per_rank // MICRO
    for mb in range(micro_per_rank):
        same_step = [ref_metrics[mb], ref_metrics[micro_per_rank + mb]]  # rank 0 and 1, step mb
        for result in results:
            values = result["dp"][2][mb]
            assert values[key] == pytest.approx(_ratio(same_step, key), rel=1e-6)
            assert values["loss"] == pytest.approx(
                (ref_losses[mb] + ref_losses[micro_per_rank + mb]) / 2, rel=1e-6)

    # The log-prob pass helper (prev_logprobs and prev_entropy) on TP shards.
    ref_lp, ref_ent = hb.full_vocab_logprobs_entropy(batch["logits"], batch["ids"])
    for result in results:
        torch.testing.assert_close(result["helper"][0], ref_lp, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(result["helper"][1], ref_ent, rtol=RTOL, atol=ATOL)


def test_missing_keys_and_empty_micro_batch():
    from nemo_sspo.integrations.nemo_aligner import make_actor_loss_func

    batch = hb.global_batch(4)
    actor = _actor_batch(batch, slice(0, 2))
    with pytest.raises(ValueError, match="prev_entropy"):
        make_actor_loss_func({k: v for k, v in actor.items() if k != "prev_entropy"},
                             tp_group=None, dp_group=None, old_entropy_source="batch")
    # No valid token (all responses truncated): loss 0 with a zero gradient, as the host does.
    actor["is_end"] = torch.zeros(2)
    logits = batch["logits"][:2].clone().requires_grad_(True)
    loss, metrics = make_actor_loss_func(actor, tables=hb.tables(), tp_group=None,
                                         dp_group=None, vocab_size=hb.VOCAB)(logits)
    loss.backward()
    assert float(loss) == 0.0 and not logits.grad.any() and float(metrics["loss"]) == 0.0


def test_current_entropy_source_and_example_section():
    """On-policy, "current" equals the stored old entropy; the example YAML section builds."""
    import os

    from omegaconf import OmegaConf

    from nemo_sspo.integrations.nemo_aligner import make_actor_loss_func

    batch = hb.global_batch(5)
    actor = _actor_batch(batch, slice(0, 4))
    _, entropy = hb.full_vocab_logprobs_entropy(batch["logits"][:4], batch["ids"][:4])
    actor["prev_entropy"] = entropy
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "integrations",
                        "nemo_aligner", "sspo_grpo_actor.yaml")
    section = OmegaConf.to_container(OmegaConf.load(path).model.nemo_sspo)
    common = dict(loss_name=section["loss_name"], loss_config=section["config"],
                  advantage_layout=section["advantage_layout"], mask_rule=section["mask_rule"],
                  tables=hb.tables(), tp_group=None, dp_group=None, vocab_size=hb.VOCAB)
    current = make_actor_loss_func({k: v for k, v in actor.items() if k != "prev_entropy"},
                                   old_entropy_source=section["old_entropy_source"], **common)
    stored = make_actor_loss_func(actor, old_entropy_source="batch", **common)
    assert section["old_entropy_source"] == "current"
    logits = batch["logits"][:4]
    assert float(current(logits)[0]) == pytest.approx(float(stored(logits)[0]), rel=RTOL)


def test_last_token_advantage_layout():
    """A_i at the last response token only (NeMo-Aligner's calculate_ppo_rewards layout)."""
    from nemo_sspo.integrations.nemo_aligner import make_actor_loss_func

    batch = hb.global_batch(6)
    actor = _actor_batch(batch, slice(0, 4))
    mask = actor["mask"].bool()
    last = torch.arange(mask.shape[1]) == (mask * torch.arange(mask.shape[1])).amax(1, True)
    last_token = dict(actor, advantages=torch.where(mask & last, actor["advantages"], 0.0))
    common = dict(tables=hb.tables(), tp_group=None, dp_group=None, vocab_size=hb.VOCAB)
    logits = batch["logits"][:4]
    broadcast = make_actor_loss_func(actor, **common)(logits)[0]
    assert float(make_actor_loss_func(last_token, advantage_layout="last_token", **common)(
        logits)[0]) == pytest.approx(float(broadcast), rel=RTOL)
    with pytest.raises(ValueError, match="non-zero before the last token"):
        make_actor_loss_func(actor, advantage_layout="last_token", **common)(logits)
