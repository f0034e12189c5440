"""Every registered policy loss under context parallelism 2 (Megatron's load-balanced split,
emulated on CPU over gloo) equals the loss on the unsplit sequence.

One spawn of 2 ranks runs the whole loss table. The micro-batch ([6, 16], float64) is built so
that the cross-CP reductions matter: with chunks of 4 positions, rank 0 holds columns 0-3 and
12-15, rank 1 columns 4-11. Its rows:

- 0: a response over columns 1-14 (every chunk) whose segments cross the chunk boundaries;
- 1: a response over columns 5-9, all on rank 1 (rank 0 sees the row empty);
- 2: no valid token (an empty response: counted nowhere);
- 3: a response over columns 2-13 with masked holes inside, segments crossing 3|4 and 11|12;
- 4: a response over columns 12-15, all on rank 0;
- 5: a "packed-like" row: two runs of tokens (columns 0-6 and 9-15) whose segment ids continue
  across the gap, one segment spanning ranks 0 and 1.

Each rank takes its columns (``split_sequence``), builds its ``CPContext`` from the real gloo
group (``make_cp_context``) and runs ``policy_loss_sums``; the parent sums the numerators and
denominators, places each rank's gradients (w.r.t. logprobs and the current entropy) back at its
positions, and compares with ``policy_loss_sums`` on the unsplit batch in one process: the
reference is the CP = 1 code path, itself pinned to hand values in tests/unit.

The same spawn runs the trainer's forward step under CP (``policy_forward_step`` with
``LossSpec.cp_group``, Megatron's parallel state initialised with context_parallel_size=2) on a
stand-in model whose logits depend on each input token alone (so the split input gives the split
logits without CP attention, which needs TransformerEngine): a micro-batch of width 14 is padded
to 16, split, and its loss, its gradient (all-reduced over the CP group as Megatron's DDP does)
and its forward-only log-probs equal the CP = 1 step's.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.loss_cases import loss_case

WIDTH, CP = 16, 2
MAX_RESPONSE_LENGTH = 16

# Per-loss overrides of the second configuration, so that every term is exercised: reference KL
# and entropy bonus for all; a selection that picks several tokens for the covariance losses.
_SELECTING = {"clip_cov": {"select_fraction": 0.1, "cov_min": -50.0, "cov_max": 50.0},
              "kl_cov": {"select_fraction": 0.1}}
_EXTRA = [("sspo", {"aggregation": "seq-mean-token-sum", "segmentation": "newline"}),
          ("sppo", {"segmentation": "response", "eps_low": 3e-4, "eps_high": 4e-4}),
          ("lpo", {"segmentation": "fixed_k", "segment_k": 3})]


def _cases() -> list[tuple[str, dict]]:
    from nemo_sspo.algorithms.losses import policy_loss_names

    cases = []
    for name in policy_loss_names():
        loss_case(name)  # every registered loss has its row of hand values
        cases.append((name, {}))
        cases.append((name, {"kl_coef": 0.05, "entropy_coef": 0.01, **_SELECTING.get(name, {})}))
    return cases + _EXTRA


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(28)
    rows = 6
    mask = torch.zeros(rows, WIDTH, dtype=torch.bool)
    mask[0, 1:15] = True
    mask[1, 5:10] = True
    mask[3, 2:14] = True
    mask[3, [6, 10]] = False
    mask[4, 12:16] = True
    mask[5, 0:7] = True
    mask[5, 9:16] = True
    # Segment ids numbered within the row; boundaries after the listed columns (crossing chunks).
    closes = {0: [2, 5, 9, 13], 1: [7], 3: [4, 12], 4: [13], 5: [1, 11]}
    segments = torch.full((rows, WIDTH), -1, dtype=torch.int64)
    for row in range(rows):
        seg = 0
        for col in range(WIDTH):
            if mask[row, col]:
                segments[row, col] = seg
                if col in closes.get(row, []):
                    seg += 1
    old = -torch.rand(rows, WIDTH, generator=g, dtype=torch.float64) * 3 - 0.05
    scale = torch.tensor([0.4, 0.05, 0.3, 0.2, 0.6, 0.1], dtype=torch.float64)[:, None]
    logprobs = old + scale * torch.randn(rows, WIDTH, generator=g, dtype=torch.float64)
    return dict(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=torch.tensor([1.0, -0.7, 0.5, -1.3, 0.9, -0.4], dtype=torch.float64),
        response_mask=mask,
        segment_ids=segments,
        old_entropy=torch.rand(rows, WIDTH, generator=g, dtype=torch.float64) * 1.5,
        ref_logprobs=old + 0.1 * torch.randn(rows, WIDTH, generator=g, dtype=torch.float64),
        entropy=torch.rand(rows, WIDTH, generator=g, dtype=torch.float64) * 2,
        token_weights=0.5 + torch.rand(rows, WIDTH, generator=g, dtype=torch.float64),
    )


def _run(batch, name, params, cp=None, cp_rank=None):
    """``(numerator, denominator, pairs, grad logprobs, grad entropy)`` of one loss."""
    from nemo_sspo.algorithms.losses import (
        LossInputs,
        build_policy_loss_config,
        make_policy_loss,
        policy_loss_sums,
    )
    from nemo_sspo.parallel.context_parallel import split_sequence

    fields = {}
    for key, value in batch.items():
        if value.dim() == 2 and cp is not None:
            value = split_sequence(value, CP, cp_rank)
        fields[key] = value.clone().requires_grad_(key in ("logprobs", "entropy"))
    loss = make_policy_loss(name, build_policy_loss_config(name, params))
    numerator, denominator, metrics = policy_loss_sums(
        loss, LossInputs(**fields, context_parallel=cp), max_response_length=MAX_RESPONSE_LENGTH)
    numerator.backward()
    grads = [fields[key].grad if fields[key].grad is not None else torch.zeros_like(fields[key])
             for key in ("logprobs", "entropy")]
    pairs = {key: (float(p.total), float(p.count), p.kind) for key, p in metrics.items()}
    return float(numerator.detach()), float(denominator), pairs, *grads


def _cp_rank_fn(rank, world_size):
    import torch.distributed as dist

    from nemo_sspo.parallel.context_parallel import (
        gather_sequence,
        make_cp_context,
        split_sequence,
        zigzag_positions,
    )

    torch.manual_seed(0)
    group = dist.new_group(list(range(world_size)))
    positions = zigzag_positions(WIDTH, CP, rank)
    cp = make_cp_context(group, positions, WIDTH)
    batch = _batch()
    gathered = gather_sequence(split_sequence(batch["logprobs"], CP, rank), group)
    return {"positions": positions, "gathered": gathered, "step": _step_under_cp(),
            "hand": _hand_case(make_cp_context(group, zigzag_positions(8, CP, rank), 8), rank),
            "results": [_run(batch, name, params, cp, rank) for name, params in _cases()]}


def _hand_case(cp, rank):
    """docs/pitfalls.md#cp-split-segment: S = 8, CP = 2 (rank 0: columns 0, 1, 6, 7; rank 1: 2-5).
    Row 0: one segment over columns 2-7, d = 0.1 on 2-5 (rank 1) and 0.4 on 6-7 (rank 0), A = +1;
    row 1: columns 6-7 only (rank 0), d = 0, A = -1."""
    from nemo_sspo.algorithms.aggregation import aggregate
    from nemo_sspo.algorithms.ratios import segment_mean
    from nemo_sspo.parallel.context_parallel import split_sequence

    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 2:] = True
    mask[1, 6:] = True
    d = torch.zeros(2, 8, dtype=torch.float64)
    d[0, 2:6], d[0, 6:] = 0.1, 0.4
    ids = torch.where(mask, 0, -1)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    local_mask, local_d, local_ids = (split_sequence(x, CP, rank) for x in (mask, d, ids))
    mean, length = segment_mean(local_d, local_ids, local_mask, cp=cp)
    per_token = torch.where(local_mask, -advantages[:, None], torch.zeros((), dtype=torch.float64))
    numerator, denominator = aggregate(per_token, local_mask, "seq-mean-token-mean", cp=cp)
    return {"mean": mean[0][local_mask[0]].tolist(), "length": length[0][local_mask[0]].tolist(),
            "pair": (float(numerator), float(denominator))}


class _TokenwiseModel(torch.nn.Module):
    """Logits ``table[input_id]`` at every position: a stand-in GPTModel whose outputs depend on
    the position's own token only (``config.context_parallel_size`` read by ``forward_logits``)."""

    def __init__(self, vocab: int, cp_size: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(3)))
        self.config = type("Config", (), {"context_parallel_size": cp_size})()

    def forward(self, input_ids, position_ids, attention_mask):
        return self.table[input_ids]


def _step_micro_batch(vocab: int):
    from nemo_sspo.algorithms.batch import PolicyBatch
    from nemo_sspo.algorithms.micro_batches import MicroBatch

    full = _batch()  # its first 14 columns, float32 as the trainer's batch
    width, rows = 14, full["response_mask"].shape[0]
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, vocab, (rows, width), generator=g)
    targets = torch.cat([input_ids[:, 1:], torch.zeros(rows, 1, dtype=torch.int64)], dim=1)
    mask = full["response_mask"][:, :width].clone()
    mask[:, -1] = False
    batch = PolicyBatch(
        input_ids=input_ids, position_ids=torch.arange(width).expand(rows, -1).clone(), targets=targets,
        loss_mask=mask, segment_ids=torch.where(mask, full["segment_ids"][:, :width], -1),
        old_logprobs=full["old_logprobs"][:, :width].float(), old_entropy=full["old_entropy"][:, :width].float(),
        advantages=full["advantages"].float(), tis_weights=full["token_weights"][:, :width].float())
    return MicroBatch(batch, torch.arange(rows), batch.input_ids, batch.position_ids)


def _step_under_cp():
    import torch.distributed as dist

    from nemo_sspo.algorithms.losses import make_policy_loss
    from nemo_sspo.megatron.parallel_setup import destroy_parallel, get_parallel_groups, initialize_parallel
    from nemo_sspo.megatron.step import LossSpec, policy_forward_step

    vocab = 11
    initialize_parallel(tp_size=1, pp_size=1, seed=0, cp_size=CP)
    try:
        groups = get_parallel_groups()
        spec = LossSpec(loss=make_policy_loss("sspo"), tp_group=None, vocab_start=0, vocab_size=vocab,
                        temperature=1.0, max_response_length=MAX_RESPONSE_LENGTH, output_chunk_size=None)
        cp_spec = LossSpec(**{**spec.__dict__, "cp_group": groups.cp_group})
        out = {"layout": (groups.cp_size, groups.cp_rank, groups.dp_size)}
        for name, used, cp_size in (("cp1", spec, 1), ("cp2", cp_spec, CP)):
            model = _TokenwiseModel(vocab, cp_size)
            step = policy_forward_step(used, compute_loss=True)
            output, loss_func = step(iter([_step_micro_batch(vocab)]), model)
            numerator, denominator, metrics = loss_func(output)
            numerator.backward()
            sums = torch.stack([numerator.detach().double(), denominator.double()])
            grad = model.table.grad.clone()
            if cp_size > 1:  # what Megatron's finalize_model_grads and DDP do over data x context
                dist.all_reduce(sums, group=groups.cp_group)
                dist.all_reduce(grad, group=groups.cp_group)
            forward_only = policy_forward_step(used, compute_loss=False)
            output, loss_func = forward_only(iter([_step_micro_batch(vocab)]), model)
            stats = loss_func(output.detach())[2]
            out[name] = {"sums": sums, "grad": grad, "logprobs": stats["logprobs"],
                         "ratio": float(metrics["policy/ratio"].total), "count": float(metrics["policy/ratio"].count)}
        return out
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def cp_results(run_distributed):
    return run_distributed(_cp_rank_fn, CP)


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


def test_cp2_equals_cp1_for_every_registered_loss(cp_results):
    batch = _batch()
    cases = _cases()
    worst = {"value": 0.0, "grad": 0.0, "metric": 0.0}
    for index, (name, params) in enumerate(cases):
        label = f"{name} {params}"
        num, den, pairs, grad_lp, grad_ent = _run(batch, name, params)
        ranks = [r["results"][index] for r in cp_results]
        cp_num = sum(r[0] for r in ranks)
        cp_den = sum(r[1] for r in ranks)
        assert _close(cp_num, num, 1e-10), (label, cp_num, num)
        assert cp_den == den, (label, cp_den, den)
        worst["value"] = max(worst["value"], abs(cp_num - num))
        for which, reference in ((3, grad_lp), (4, grad_ent)):
            merged = torch.zeros_like(reference)
            for r, result in zip(cp_results, ranks, strict=True):
                merged[:, r["positions"]] = result[which]
            diff = float((merged - reference).abs().max())
            worst["grad"] = max(worst["grad"], diff)
            assert diff <= 1e-10 * max(1.0, float(reference.abs().max())), (label, which, diff)
        assert float(grad_lp.abs().sum()) > 0, label  # the comparison is not of zeros
        for rank, result in enumerate(ranks):
            assert result[2].keys() == pairs.keys(), (label, rank)
            for key, (total, count, kind) in pairs.items():
                got = result[2][key]
                assert got[2] == kind, (label, key)
                assert _close(got[1], count, 1e-6), (label, rank, key, got, (total, count))
                assert _close(got[0], total, 1e-5), (label, rank, key, got, (total, count))
                worst["metric"] = max(worst["metric"], abs(got[0] - total) / max(1.0, abs(total)))
    print(f"max |CP2 - CP1|: {worst}")


def test_selection_losses_select_and_cross_the_split(cp_results):
    """The batch exercises what the reductions exist for: the covariance losses select tokens on
    both ranks, and SSPO's segments are split over the ranks."""
    batch = _batch()
    cases = _cases()
    index = cases.index(("kl_cov", {"kl_coef": 0.05, "entropy_coef": 0.01, **_SELECTING["kl_cov"]}))
    fractions = [r["results"][index][2]["policy/cov_selected_frac"] for r in cp_results]
    assert fractions[0][0] == fractions[1][0] >= 2  # several tokens selected over both ranks
    positions = [r["positions"] for r in cp_results]
    segments = batch["segment_ids"]
    crossing = [(row, seg) for row in range(segments.shape[0]) for seg in range(WIDTH)
                if all(bool((segments[row, p] == seg).any()) for p in positions)]
    assert len(crossing) >= 3, crossing


def test_gather_sequence_undoes_the_split(cp_results):
    for result in cp_results:
        assert torch.equal(result["gathered"], _batch()["logprobs"])


def test_forward_step_under_cp_equals_cp1(cp_results):
    for rank, result in enumerate(cp_results):
        step = result["step"]
        assert step["layout"] == (CP, rank, 1)  # both ranks split one replica's sequences
        one, two = step["cp1"], step["cp2"]
        assert torch.allclose(two["sums"], one["sums"], rtol=1e-6, atol=1e-7), (one["sums"], two["sums"])
        assert two["sums"][1] == one["sums"][1] == 5  # the non-empty responses, counted once
        assert float(one["grad"].abs().sum()) > 0
        assert torch.allclose(two["grad"], one["grad"], rtol=1e-5, atol=1e-7)
        assert two["logprobs"].shape == one["logprobs"].shape == (6, 14)
        assert torch.equal(two["logprobs"], one["logprobs"])
        assert math.isclose(two["ratio"], one["ratio"], rel_tol=1e-6) and two["count"] == one["count"]


def test_hand_worked_split_segment_and_response_count(cp_results):
    """docs/pitfalls.md#cp-split-segment, by hand: row 0's segment mean is (4 x 0.1 + 2 x 0.4) / 6
    = 0.2 on both ranks (per chunk it would be 0.1 and 0.4) over 6 tokens; seq-mean-token-mean at
    ratio 1: rank 0 adds -2/6 (row 0) + 2/2 (row 1) = 2/3 and counts both responses, rank 1 adds
    -4/6 and counts none, so the loss is (2/3 - 2/3) / 2 = 0, the CP = 1 value (counting the
    responses each rank sees with local lengths gives (-1 + 1 - 1) / 3 = -1/3)."""
    rank0, rank1 = (r["hand"] for r in cp_results)
    assert rank0["mean"] == pytest.approx([0.2, 0.2], abs=1e-15)
    assert rank1["mean"] == pytest.approx([0.2] * 4, abs=1e-15)
    assert rank0["length"] == [6.0, 6.0] and rank1["length"] == [6.0] * 4
    assert rank0["pair"] == pytest.approx((2 / 3, 2.0), abs=1e-15)
    assert rank1["pair"] == pytest.approx((-2 / 3, 0.0), abs=1e-15)
