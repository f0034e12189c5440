"""The policy loss gives the same loss and parameter gradients for every parallel layout.

Layouts (TP, PP, DP, gradient-accumulation steps, sequence parallelism) are checked against the
single-process run (1, 1, 1, 1, no SP) for every aggregation mode: SSPO, GSPO, GRPO (seq-mean-token-mean), DAPO and CISPO
(token-mean), GRPO with seq-mean-token-sum, Dr. GRPO (constant-denominator), on one fixed batch
with unequal response lengths, a zero-length response and a fully masked micro-batch (docs/pitfalls.md#p11, docs/pitfalls.md#p12).
The single-process run itself is checked against a float64 Hugging Face model with each objective
written out independently (Python loops over responses and segments). Each layout also runs with
other batchings (``BATCHINGS``): the fused output layer, token-budget micro-batches and packed
sequences must give the same loss and gradients as materialised logits on padded rows; under
DP those two balance the rows by tokens across data-parallel ranks first, as the trainer does.
TP 2 with sequence parallelism runs the fused output layer and packing: its rows (11 tokens wide,
packed rows too) are padded to a multiple of 2 inside the forward, and each TP rank's first norm
must see half the padded positions (docs/pitfalls.md#sequence-parallelism).

After the last loss, each layout takes one optimizer step: its global gradient norm must equal
the norm of the gathered gradients with every parameter counted once (TP-replicated norms and
the tied embedding too), and under PP=2 the tied input embedding (first stage) and output layer
(last stage) must have the same, summed gradient and stay equal after the step.

Three spawns (worlds 1, 2, 4) run all layouts; rank 0 of each returns its results.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from nemo_sspo.algorithms.losses import (
    CISPOLossConfig,
    DAPOLossConfig,
    DrGRPOLossConfig,
    GRPOLossConfig,
    GSPOLossConfig,
    KLCovLossConfig,
    SSPOLossConfig,
    make_policy_loss,
)
from nemo_sspo.algorithms.batch import pack_rollouts

# HF names of parameters that TP ranks hold whole copies of (a norm counted per rank would
# count them tp times); lm_head.weight is the embedding itself in this tied model.
TP_REPLICATED = ("input_layernorm", "post_attention_layernorm", "model.norm")
TIED_HEAD = "lm_head.weight"
NORM_RTOL = 5e-6

TEMPERATURE = 0.8
ROWS = 8
RESPONSE_LENGTHS = [5, 3, 7, 1, 0, 6, 0, 0]  # rows 6-7: a fully masked micro-batch at 2 rows per micro-batch
PROMPT_LENGTHS = [3, 2, 4, 2, 3, 5, 2, 3]
ADVANTAGES = [1.0, -0.5, 0.7, -1.2, 0.3, 0.9, -0.4, 0.0]
# The contract's stated exception (nemo_sspo/megatron/step.py): covariance methods select tokens
# within each micro-batch, so they are invariant to TP and PP but not to how rows are split into
# micro-batches (DP, gradient accumulation). k = 0.05 selects max(1, floor(0.05 N)) tokens per call.
MICRO_BATCH_LOCAL = {"kl_cov": ("kl_cov", KLCovLossConfig(select_fraction=0.05, cov_kl_coef=1.0))}
MAX_RESPONSE_LENGTH = 8  # L_max of the constant-denominator mode
# case -> (registered loss, config); every config spells out what the reference below reads.
LOSSES = {
    "sspo": ("sspo", SSPOLossConfig(alpha=0.0, beta=0.8, gamma=1.1)),  # gamma 1.1: the upper bound binds
    "gspo": ("gspo", GSPOLossConfig(eps_low=0.05, eps_high=0.05)),
    "grpo": ("grpo", GRPOLossConfig(eps_low=0.2, eps_high=0.2, dual_clip_c=None)),
    "dapo": ("dapo", DAPOLossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=None, aggregation="token-mean")),
    "cispo": ("cispo", CISPOLossConfig(eps_low_is=1.0, eps_high_is=0.1, aggregation="token-mean")),
    "grpo_seq_sum": ("grpo", GRPOLossConfig(eps_low=0.2, eps_high=0.2, dual_clip_c=None,
                                            aggregation="seq-mean-token-sum")),
    "dr_grpo": ("dr_grpo", DrGRPOLossConfig(eps_low=0.2, eps_high=0.2, dual_clip_c=None,
                                            aggregation="constant-denominator")),
}
# How the rows become micro-batches and where the output layer runs (the last one listed for a
# layout is the one its optimizer step uses):
# - "logits": fixed rows per micro-batch, Megatron's output layer, full logits (the reference);
# - "fused": fixed rows, the fused output layer in chunks of 3 tokens (the default path);
# - "budget": micro-batches of at most 24 padded tokens, rows grouped by length (fused);
# - "packed": sequences end to end in rows of 11 tokens (fused). Lengths prompt + response are
#   [8, 5, 11, 3, 3, 11, 2, 3]: first-fit decreasing packs [11] [11] [8 3] [5 3 3] [2], so three
#   rows end exactly at the row boundary and rows 4, 6, 7 hold zero-length responses.
BATCHINGS = {
    "logits": dict(output_chunk_size=None, max_tokens=None, pack=False),
    "fused": dict(output_chunk_size=3, max_tokens=None, pack=False),
    "budget": dict(output_chunk_size=3, max_tokens=24, pack=False),
    "packed": dict(output_chunk_size=3, max_tokens=11, pack=True),
}
# world size -> layouts (tp, pp, grad-accumulation steps, sequence parallel, batchings); DP = world / (tp * pp)
LAYOUTS = {
    1: [(1, 1, 1, False, ("budget", "packed", "logits", "fused")), (1, 1, 4, False, ("fused",))],
    2: [(2, 1, 1, False, ("logits", "budget", "packed", "fused")),
        (2, 1, 1, True, ("packed", "fused")),  # SP: the default path and packing (27 s of the spawn)
        (1, 2, 1, False, ("logits", "budget", "packed", "fused")),
        (1, 1, 1, False, ("budget", "packed", "fused")), (1, 2, 2, False, ("fused",))],
    4: [(2, 2, 1, False, ("fused",)), (2, 1, 2, False, ("fused",))],
}
REFERENCE = (1, 1, 1, 1, False, "logits")
LAST = "fused"  # the batching of each layout's optimizer step


def _tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
    )


def _fixture_data():
    """HF weights and a packed batch, built identically in every process from fixed seeds."""
    from transformers import LlamaForCausalLM

    config = _tiny_config()
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    p_max, t_max = max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    prompt_ids = torch.zeros(ROWS, p_max, dtype=torch.long)
    response_ids = torch.zeros(ROWS, t_max, dtype=torch.long)
    segments = torch.full((ROWS, t_max), -1, dtype=torch.long)
    for b, (p, t) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        prompt_ids[b, p_max - p :] = torch.randint(1, 101, (p,), generator=gen)
        response_ids[b, :t] = torch.randint(1, 101, (t,), generator=gen)
        # segment boundaries after a random subset of tokens (the last token always closes one)
        closes = torch.rand(t, generator=gen) < 0.4
        segments[b, :t] = torch.cat([torch.zeros(1, dtype=torch.long), closes[:-1].long().cumsum(0)])[:t]
    prompt_mask = torch.arange(p_max)[None, :] >= (p_max - torch.tensor(PROMPT_LENGTHS))[:, None]
    response_mask = torch.arange(t_max)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    batch = pack_rollouts(prompt_ids, prompt_mask, response_ids, response_mask, segments,
                          torch.tensor(ADVANTAGES), pad_id=0)
    noise = 0.3 * torch.randn(batch.loss_mask.shape, generator=gen) * batch.loss_mask
    return config, {k: v.clone() for k, v in hf.state_dict().items()}, batch, noise


def _grads_as_hf(ddp_model, hf_config):
    """Exports the step's gradients (Megatron ``main_grad``) under HF names, gathered over TP/PP."""
    from nemo_sspo.megatron import export_hf_state_dict

    params = list(ddp_model.module.parameters())
    saved = [p.data.clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.data.copy_(p.main_grad)
        grads = export_hf_state_dict(ddp_model.module, hf_config)
        for p, s in zip(params, saved):
            p.data.copy_(s)
    return grads


def _tied_copies(ddp_model, groups):
    """PP > 1: the shared embedding/output weight and its gradient of every stage, gathered over
    the pipeline group (first stage: input embedding; last stage: output layer)."""
    import torch.distributed as dist

    weight = ddp_model.module.shared_embedding_or_output_weight()
    copies = {}
    for name, tensor in (("grad", weight.main_grad), ("weight", weight.data)):
        gathered = [torch.empty_like(tensor) for _ in range(groups.pp_size)]
        dist.all_gather(gathered, tensor.contiguous(), group=groups.pp_group)
        copies[name] = gathered
    return copies


def _run_layouts(rank, world_size):
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, get_parallel_groups,
                                    initialize_parallel, load_hf_into_megatron, vocab_shard)
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import (apply_optimizer_step, compute_gradients,
                                             compute_old_logprobs, wrap_for_training)
    from nemo_sspo.parallel.data_balance import balance_across_data_parallel
    from nemo_sspo.parallel.metric_reduce import reduce_metric_sums

    hf_config, hf_state, batch, noise = _fixture_data()
    results = {}
    for tp, pp, ga, sp, batchings in LAYOUTS[world_size]:
        dp = world_size // (tp * pp)
        initialize_parallel(tp_size=tp, pp_size=pp, seed=0)
        groups = get_parallel_groups()
        model = build_policy_model(hf_config, sequence_parallel=sp)
        widths = []  # (input width, positions this rank's first norm saw) per forward
        norm = model.decoder.layers[0].input_layernorm if groups.is_first_stage else None
        hook = None if norm is None else norm.register_forward_hook(
            lambda module, args, output, seen=widths: seen.append(args[0].shape[0]))
        load_hf_into_megatron(model, hf_state, hf_config)
        ddp, optimizer = wrap_for_training(model, lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                                   adam_eps=1e-8, clip_grad=0.0)
        rows = ROWS // dp
        local = batch.select(slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows))
        local_noise = noise[groups.dp_rank * rows : (groups.dp_rank + 1) * rows]
        vocab_start, vocab_size = vocab_shard(model)
        for batching in batchings:
            option = BATCHINGS[batching]
            layout = MicroBatchLayout(micro_batch_size=None if option["max_tokens"] else rows // ga,
                                      max_tokens=option["max_tokens"], pack=option["pack"])
            for name, (registered, loss_config) in {**MICRO_BATCH_LOCAL, **LOSSES}.items():
                spec = LossSpec(loss=make_policy_loss(registered, loss_config),
                                tp_group=groups.tp_group if tp > 1 else None, vocab_start=vocab_start,
                                vocab_size=vocab_size, temperature=TEMPERATURE,
                                max_response_length=MAX_RESPONSE_LENGTH,
                                output_chunk_size=option["output_chunk_size"])
                scored = compute_old_logprobs(ddp, local, spec, layout, dp_group=groups.dp_group)
                scored = replace(scored, old_logprobs=scored.old_logprobs + local_noise)  # off-policy: ratio != 1
                if option["max_tokens"]:  # rows balanced by tokens over DP ranks (the trainer does it
                    # before the old log-probs; a row's results do not depend on its rank)
                    scored = balance_across_data_parallel(scored, groups.dp_group)
                sums = compute_gradients(ddp, scored, spec, layout, dp_group=groups.dp_group)
                if name == "sspo":
                    results[(tp, pp, dp, ga, sp, batching, "norm_positions")] = sorted(set(widths))
                widths.clear()
                metrics = reduce_metric_sums(sums, dp_group=groups.dp_group, pp_group=groups.pp_group,
                                             last_stage_rank=groups.pp_last_rank,
                                             is_last_stage=groups.is_last_stage)
                grads = _grads_as_hf(ddp, hf_config)
                results[(tp, pp, dp, ga, sp, batching, name)] = (
                    metrics["loss/policy"], metrics["policy/clipfrac_tokens"], grads)
        # One optimizer step on the last loss's gradients (still in main_grad).
        tied_before = _tied_copies(ddp, groups) if pp > 1 else None
        grad_norm = apply_optimizer_step(optimizer)
        tied_after = _tied_copies(ddp, groups) if pp > 1 else None
        results[(tp, pp, dp, ga, sp, "step")] = (grad_norm, tied_before, tied_after)  # after LAST
        if hook is not None:
            hook.remove()
        destroy_parallel()
    return results if rank == 0 else None


def _segments(name, b, cols, batch):
    """Token columns of each ratio unit of response ``b``: tokens, the whole response, or SSPO's
    segments."""
    if name == "gspo":
        return [cols]
    if name != "sspo":
        return [[c] for c in cols]
    ids = batch.segment_ids[b]
    return [[c for c in cols if ids[c] == j] for j in sorted({int(ids[c]) for c in cols})]


def _unit_objective(name, cfg, seg, b, logp, old, entropy):
    """J contribution of one ratio unit: |unit| * surrogate (SSPO eq. 16's |y_ij| weight)."""
    adv = ADVANTAGES[b]
    s = torch.exp(sum(logp[b, c] - old[b, c] for c in seg) / len(seg))  # eq. 9 (|seg| = 1: token ratio)
    if name == "cispo":  # MiniMax-M1 eq. for CISPO: sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi
        weight = torch.clamp(s.detach(), 1 - cfg.eps_low_is, 1 + cfg.eps_high_is)
        return weight * adv * logp[b, seg[0]]
    if name == "sspo":
        h = sum(float(entropy[b, c]) for c in seg) / len(seg)  # eq. 13
        lo, hi = max(0.0, min(1 - h, cfg.beta)), min(1 + cfg.alpha + h, cfg.gamma)  # eq. 14/15
    else:
        lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
    return len(seg) * torch.minimum(s * adv, torch.clamp(s, lo, hi) * adv)


def _float64_reference(name: str):
    """Loss and HF-parameter gradients in float64, each objective written out with loops."""
    from transformers import LlamaForCausalLM

    hf_config, hf_state, batch, noise = _fixture_data()
    model = LlamaForCausalLM(hf_config).double()
    model.load_state_dict({k: v.double() for k, v in hf_state.items()})
    logits = model(batch.input_ids).logits / TEMPERATURE
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.targets[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    old = logp.detach() + noise.double()
    cfg = LOSSES[name][1]
    numerator, responses, tokens = 0.0, 0, 0
    for b in range(ROWS):
        cols = batch.loss_mask[b].nonzero().flatten().tolist()
        if not cols:
            continue  # zero-length responses do not count (docs/pitfalls.md#p12)
        response_sum = sum(_unit_objective(name, cfg, seg, b, logp, old, entropy)
                           for seg in _segments(name, b, cols, batch))
        if cfg.aggregation == "seq-mean-token-mean":
            response_sum = response_sum / len(cols)
        elif cfg.aggregation == "constant-denominator":  # Dr. GRPO: L_max replaces |y_i|
            response_sum = response_sum / MAX_RESPONSE_LENGTH
        numerator = numerator - response_sum
        responses, tokens = responses + 1, tokens + len(cols)
    loss = numerator / (tokens if cfg.aggregation == "token-mean" else responses)
    loss.backward()
    return float(loss.detach()), {k: p.grad.detach() for k, p in model.named_parameters()}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def layout_results(run_distributed):
    results = {}
    for world in LAYOUTS:
        results.update(run_distributed(_run_layouts, world, timeout_s=900)[0])
    return results


@pytest.mark.parametrize("loss", list(LOSSES))
def test_single_process_matches_float64_reference(layout_results, loss):
    ref_loss, ref_grads = _float64_reference(loss)
    got_loss, clipfrac, got_grads = layout_results[(*REFERENCE, loss)]
    assert math.isclose(got_loss, ref_loss, rel_tol=1e-5, abs_tol=1e-7)
    assert 0.0 < clipfrac < 1.0  # some tokens clipped, some not: both branches are exercised
    for key, ref in ref_grads.items():
        if key == "lm_head.weight":  # tied to the embedding: HF reports the shared grad there
            continue
        assert _rel_err(got_grads[key], ref) < 1e-4, key


# (tp, pp, dp, ga, sp) of every layout, and with each of its batchings
_LAYOUTS = [(tp, pp, w // (tp * pp), ga, sp) for w, ls in LAYOUTS.items() for tp, pp, ga, sp, _ in ls]
_RUNS = [(tp, pp, w // (tp * pp), ga, sp, b) for w, ls in LAYOUTS.items() for tp, pp, ga, sp, bs in ls for b in bs]


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("run", [run for run in _RUNS if run != REFERENCE])
def test_layout_matches_single_process(layout_results, run, loss):
    ref_loss, _, ref_grads = layout_results[(*REFERENCE, loss)]
    got_loss, _, got_grads = layout_results[(*run, loss)]
    assert math.isclose(got_loss, ref_loss, rel_tol=1e-5)
    assert got_grads.keys() == ref_grads.keys()
    for key in ref_grads:
        assert _rel_err(got_grads[key], ref_grads[key]) < 1e-5, key


def _norm_counting_each_once(grads: dict) -> float:
    """Global norm over HF-named gradients: every parameter once (the tied head is the embedding)."""
    return math.sqrt(sum(float(g.double().square().sum()) for k, g in grads.items() if k != TIED_HEAD))


@pytest.mark.parametrize("layout", _LAYOUTS)
def test_grad_norm_counts_replicated_parameters_once(layout_results, layout):
    last_loss = list(LOSSES)[-1]
    grad_norm = layout_results[(*layout, "step")][0]
    expected = _norm_counting_each_once(layout_results[(*layout, LAST, last_loss)][2])
    reference = _norm_counting_each_once(layout_results[(*REFERENCE, last_loss)][2])
    assert math.isclose(grad_norm, expected, rel_tol=NORM_RTOL), (grad_norm, expected)
    assert math.isclose(grad_norm, reference, rel_tol=NORM_RTOL), (grad_norm, reference)
    # The check can fail: counting the TP-replicated norms twice moves this norm by 8.6e-5.
    grads = layout_results[(*REFERENCE, last_loss)][2]
    twice = math.sqrt(reference**2 + sum(float(g.double().square().sum()) for k, g in grads.items()
                                         if any(part in k for part in TP_REPLICATED)))
    assert twice / reference - 1 > 10 * NORM_RTOL


@pytest.mark.parametrize("layout", [layout for layout in _LAYOUTS if layout[1] > 1])
def test_tied_embedding_summed_over_stages_and_equal_after_step(layout_results, layout):
    _, before, after = layout_results[(*layout, "step")]
    first_grad, last_grad = before["grad"][0], before["grad"][-1]
    assert torch.equal(first_grad, last_grad)  # both stages hold the sum of both contributions
    assert torch.equal(before["weight"][0], before["weight"][-1])
    assert torch.equal(after["weight"][0], after["weight"][-1])
    assert not torch.equal(after["weight"][0], before["weight"][0])  # the step moved the weight
    # The summed gradient is the single-process embedding gradient (this TP rank's vocab rows;
    # rank 0 reports TP rank 0: rows [0, V_padded / tp)).
    reference = layout_results[(*REFERENCE, list(LOSSES)[-1])][2]["model.embed_tokens.weight"]
    rows = first_grad.shape[0]
    torch.testing.assert_close(first_grad[: min(rows, reference.shape[0])].double(),
                               reference[:rows].double(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("run", [run for run in _RUNS if run != REFERENCE])
def test_covariance_selection_is_per_micro_batch(layout_results, run):
    """Same micro-batches (only TP/PP or the output layer differ): same loss and gradients. Other
    row groupings select other tokens: the loss moves by far more than the invariance tolerance,
    as the contract says."""
    ref_loss, _, ref_grads = layout_results[(*REFERENCE, "kl_cov")]
    got_loss, _, got_grads = layout_results[(*run, "kl_cov")]
    _, _, dp, ga, _, batching = run
    if dp == 1 and ga == 1 and batching in ("logits", "fused"):
        assert math.isclose(got_loss, ref_loss, rel_tol=1e-5)
        for key in ref_grads:
            assert _rel_err(got_grads[key], ref_grads[key]) < 1e-5, key
    else:
        assert abs(got_loss - ref_loss) > 1e-3 * abs(ref_loss), (got_loss, ref_loss)


@pytest.mark.parametrize("run", [run for run in _RUNS if run[4]])
def test_sequence_parallel_splits_padded_rows(layout_results, run):
    """Under SP each TP rank's first norm sees half of every (padded, even) row width, and odd
    widths occur (the fixed rows are 11 wide), so the padding is exercised; without SP the same
    batching's norm sees the unpadded widths, some of them odd."""
    tp, pp, dp, ga, _, batching = run
    split = layout_results[(*run, "norm_positions")]
    whole = layout_results[(tp, pp, dp, ga, False, batching, "norm_positions")]
    assert any(width % 2 for width in whole), whole
    assert split == sorted({-(-width // tp) for width in whole}), (split, whole)
