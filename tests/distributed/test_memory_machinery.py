"""Megatron's memory machinery changes memory, not the step.

- Distributed optimizer (``optim.use_distributed_optimizer``): 3 optimizer steps at TP 2 x DP 2 and
  PP 2 x DP 2 give the weights plain Adam gives (rel 1e-6), and each rank holds the Adam states of
  its 1/DP slice of the gradient buffer only (counted from the optimizer's state tensors).
- Activation recomputation (``parallel.recompute``): selective and full give the gradients of no
  recomputation (rel 1e-6), and the bytes autograd saves for backward fall (none > selective > full).
- Learning-rate schedule (``optim.lr_schedule``): the rate each update ran at, read from the
  optimizer, equals the schedule worked out by hand.

One spawn of 4 gloo processes runs both distributed-optimizer layouts; rank 0 returns the results.
Recomputation and the schedule run in one process (a 1-rank gloo group).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.distributed.test_invariance import _fixture_data

LAYOUTS = [(2, 1), (1, 2)]  # (tp, pp) at world size 4: DP 2 each
STEPS = 3
LR = 1e-3


def _bytes_of_states(optimizer) -> int:
    """Bytes of every tensor in the inner torch optimizers' per-parameter states (Adam's
    ``exp_avg`` and ``exp_avg_sq``; the step counters are scalars)."""
    total = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values()
                         if torch.is_tensor(t) and t.dim() > 0)
    return total


def _train(layout, distributed: bool, *, recompute: str = "none", method: str = "uniform", steps: int = STEPS,
           schedule: dict | None = None):
    """``steps`` SSPO updates of the tiny Llama on the fixture batch (off-policy noise on pi_old);
    returns the HF-named weights after them, the optimizer, and each update's learning rate."""
    from nemo_sspo.algorithms.losses import SSPOLossConfig, make_policy_loss
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, export_hf_state_dict,
                                    get_parallel_groups, initialize_parallel, load_hf_into_megatron, vocab_shard)
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import (build_lr_scheduler, compute_old_logprobs, train_on_batch,
                                             wrap_for_training)

    tp, pp = layout
    hf_config, hf_state, batch, noise = _fixture_data()
    initialize_parallel(tp_size=tp, pp_size=pp, seed=0)
    groups = get_parallel_groups()
    model = build_policy_model(hf_config, recompute=recompute, recompute_method=method, recompute_num_layers=2)
    load_hf_into_megatron(model, hf_state, hf_config)
    ddp, optimizer = wrap_for_training(model, lr=LR, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                                       adam_eps=1e-8, clip_grad=0.0, use_distributed_optimizer=distributed)
    scheduler = build_lr_scheduler(optimizer, lr=LR, **schedule) if schedule else None
    rows = batch.input_ids.shape[0] // groups.dp_size
    own = slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows)
    local, local_noise = batch.select(own), noise[own]
    vocab_start, vocab_size = vocab_shard(model)
    spec = LossSpec(loss=make_policy_loss("sspo", SSPOLossConfig(alpha=0.0, beta=0.8, gamma=1.1)),
                    tp_group=groups.tp_group if tp > 1 else None, vocab_start=vocab_start, vocab_size=vocab_size,
                    temperature=0.8, max_response_length=8, output_chunk_size=3)
    micro = MicroBatchLayout(micro_batch_size=rows // 2, max_tokens=None, pack=False)
    rates = []
    for _ in range(steps):
        scored = compute_old_logprobs(ddp, local, spec, micro, dp_group=groups.dp_group)
        scored = replace(scored, old_logprobs=scored.old_logprobs + local_noise)
        train_on_batch(ddp, optimizer, scored, spec, micro, dp_group=groups.dp_group, lr_scheduler=scheduler)
        rates.append(optimizer.param_groups[0]["lr"])
    weights = export_hf_state_dict(ddp.module, hf_config)
    result = dict(weights=weights, state_bytes=_bytes_of_states(optimizer), rates=rates,
                  params=sum(p.numel() for p in model.parameters()), dp=groups.dp_size)
    destroy_parallel()
    return result


class _PeakSavedBytes:
    """Peak bytes of the tensors autograd holds for backward (``saved_tensors_hooks``): each saved
    tensor is counted from its save until autograd frees it (after its backward ran)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def _pack(self, tensor):
        return _Held(self, tensor)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)


class _Held:
    def __init__(self, counter: _PeakSavedBytes, tensor: torch.Tensor) -> None:
        self.counter, self.tensor, self.bytes = counter, tensor, tensor.numel() * tensor.element_size()
        counter.live += self.bytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self) -> None:
        self.counter.live -= self.bytes


def _recompute_gradients(recompute: str, method: str):
    """The TP 2 x DP 2 gradients of one SSPO mini-batch (HF names, gathered) and the peak saved bytes."""
    from nemo_sspo.algorithms.losses import SSPOLossConfig, make_policy_loss
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, get_parallel_groups, initialize_parallel,
                                    load_hf_into_megatron, vocab_shard)
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import compute_gradients, compute_old_logprobs, wrap_for_training
    from tests.distributed.test_invariance import _grads_as_hf

    hf_config, hf_state, batch, noise = _fixture_data()
    initialize_parallel(tp_size=2, pp_size=1, seed=0)
    groups = get_parallel_groups()
    model = build_policy_model(hf_config, recompute=recompute, recompute_method=method, recompute_num_layers=2)
    load_hf_into_megatron(model, hf_state, hf_config)
    ddp, _ = wrap_for_training(model, lr=LR, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
                               clip_grad=0.0)
    own = slice(groups.dp_rank * 4, (groups.dp_rank + 1) * 4)
    vocab_start, vocab_size = vocab_shard(model)
    spec = LossSpec(loss=make_policy_loss("sspo", SSPOLossConfig(alpha=0.0, beta=0.8, gamma=1.1)),
                    tp_group=groups.tp_group, vocab_start=vocab_start, vocab_size=vocab_size, temperature=0.8,
                    max_response_length=8, output_chunk_size=3)
    micro = MicroBatchLayout(micro_batch_size=4, max_tokens=None, pack=False)
    scored = compute_old_logprobs(ddp, batch.select(own), spec, micro, dp_group=groups.dp_group)
    scored = replace(scored, old_logprobs=scored.old_logprobs + noise[own])
    counter = _PeakSavedBytes()
    with counter.hooks():
        compute_gradients(ddp, scored, spec, micro, dp_group=groups.dp_group)
    grads = _grads_as_hf(ddp, hf_config)
    destroy_parallel()
    return grads, counter.peak


RECOMPUTE = [("none", "uniform"), ("selective", "uniform"), ("full", "uniform"), ("full", "block")]


def _run_distributed_optimizer(rank, world_size):
    """Per layout and optimizer: this rank's state bytes and parameter count; rank 0 also the weights.
    Per recomputation setting: the gradients and peak saved bytes (rank 0)."""
    results = {}
    for layout in LAYOUTS:
        for distributed in (False, True):
            run = _train(layout, distributed)
            results[(layout, distributed)] = {**run, "weights": run["weights"] if rank == 0 else None}
    for setting in RECOMPUTE:
        results[setting] = _recompute_gradients(*setting)
    return results


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def distributed_results(run_distributed):
    return run_distributed(_run_distributed_optimizer, 4, timeout_s=600)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_distributed_optimizer_equals_plain_adam(distributed_results, layout):
    plain, sharded = distributed_results[0][(layout, False)], distributed_results[0][(layout, True)]
    initial = _fixture_data()[1]
    assert plain["weights"].keys() == sharded["weights"].keys()
    assert max(_rel_err(plain["weights"][k], initial[k]) for k in initial) > 1e-4  # the updates moved them
    for key, weight in plain["weights"].items():
        assert _rel_err(sharded["weights"][key], weight) < 1e-6, key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_distributed_optimizer_shards_adam_states_over_dp(distributed_results, layout):
    for rank_results in distributed_results:
        plain, sharded = rank_results[(layout, False)], rank_results[(layout, True)]
        # fp32 model: plain Adam keeps exp_avg and exp_avg_sq, 8 bytes for each parameter of this rank.
        assert plain["state_bytes"] == 8 * plain["params"]
        # DP 2: this rank keeps the states of its half of the gradient buffer (padded to 2 x 64 elements
        # per bucket by megatron-core), so at most 8 x (params / 2 + 64) bytes, at least 8 x params / 2 - 64.
        assert abs(sharded["state_bytes"] - plain["state_bytes"] / 2) <= 8 * 64, (sharded["state_bytes"], plain)


@pytest.mark.parametrize("setting", RECOMPUTE[1:])
def test_recompute_keeps_gradients_and_saves_fewer_bytes(distributed_results, setting):
    reference, reference_peak = distributed_results[0][RECOMPUTE[0]]
    grads, peak = distributed_results[0][setting]
    for key, grad in reference.items():
        assert _rel_err(grads[key], grad) < 1e-6, key
    assert peak < reference_peak, (setting, peak, reference_peak)


def test_saved_bytes_fall_from_selective_to_block_to_full(distributed_results):
    # block recomputes 2 of the 4 layers, uniform all 4 in chunks of 2: full uniform < block < selective
    peak = {setting: distributed_results[0][setting][1] for setting in RECOMPUTE}
    assert peak[("full", "uniform")] < peak[("full", "block")] < peak[("selective", "uniform")], peak
