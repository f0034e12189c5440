"""How much an update moves MoE routes, and what router replay R2 and R3 change (no timing).

The tiny random Qwen3-MoE (8 experts, top-2, 2 layers) on the Megatron local spec, one process.
The old policy's forward records every token's routes. Then each weight moves by
``lr * N(0, 1)``, the size of one Adam step at learning rate ``lr``, and the moved model scores
the same tokens twice: with its own routers, and with the old routes replayed (R2). Printed per
``lr``:

- ``agreement``: the share of (token, layer) pairs where the moved model's own top-2 set equals the
  old one (1.0: the update changed no route);
- ``ratio_gap_own`` / ``ratio_gap_r2``: the mean |log pi_new - log pi_old| over the target tokens,
  computed with the moved model's own routes and with the replayed routes. Replay keeps the routes
  fixed, so the ratio measures the change in weights only, not a change of experts on top of it.

Then R3, engine against trainer on one rollout: the transformers engine (``HFRolloutEngine`` with
``record_routes``) samples ``--rows`` responses of ``--new-tokens`` tokens at temperature 1 from
weights that differ slightly from the trainer's, as a rollout engine's do (``bf16``: every weight
rounded to bfloat16, what a bf16 engine holds; ``noise=x``: ``x * N(0, 1)`` added to every weight).
The trainer (Megatron, fp32, the exact weights) scores the rollout through its old-policy forward
(``forward_logprobs``) twice. Printed per engine:

- ``agreement``: share of (token, layer) pairs, at the positions the loss reads, where the trainer's
  own top-2 set equals the engine's;
- ``gap_own`` / ``gap_r3``: mean |log pi_engine - log pi_trainer| per response token, with the
  trainer's own routes and with the engine's routes replayed (R3).

    python benchmarks/moe_router_replay.py [--tokens 512] [--rows 8] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from nemo_sspo.megatron import (
    build_policy_model,
    destroy_parallel,
    forward_logits,
    initialize_parallel,
    load_hf_into_megatron,
)
from nemo_sspo.megatron.router_replay import (
    clear_routes,
    record_routes,
    recorded_routes,
    replay_routes,
    routing_agreement,
)
from nemo_sspo.models import build_hf_model, load_hf_checkpoint


def _logprobs(model, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, S-1] log-probs of the next tokens."""
    with torch.no_grad():
        logits = forward_logits(model, ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :vocab]
    return torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]


ENGINES = {
    "bf16": lambda v, _: v.to(torch.bfloat16).float(),
    "noise=1e-3": lambda v, g: v + 1e-3 * torch.randn(v.shape, generator=g),
    "noise=1e-2": lambda v, g: v + 1e-2 * torch.randn(v.shape, generator=g),
}
"""How each engine's weights differ from the trainer's (the R3 section)."""


def _engine_vs_trainer(config, state, tokenizer, trainer, rows: int, new_tokens: int) -> None:
    """The R3 lines (module docstring)."""
    from nemo_sspo.algorithms.batch import PolicyBatch
    from nemo_sspo.algorithms.losses import GRPOLossConfig, make_policy_loss
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import compute_old_logprobs, forward_logprobs
    from nemo_sspo.rollout import HFRolloutEngine

    spec = LossSpec(loss=make_policy_loss("grpo", GRPOLossConfig()), tp_group=None, vocab_start=0,
                    vocab_size=config.vocab_size, temperature=1.0, max_response_length=new_tokens,
                    output_chunk_size=None)
    layout = MicroBatchLayout(micro_batch_size=rows)
    prompts = [f"Problem {i}: what is {i} + {2 * i}? Think step by step." for i in range(rows)]
    for name, change in ENGINES.items():
        generator = torch.Generator().manual_seed(2)
        weights = {k: change(v, generator) for k, v in state.items()}
        engine = HFRolloutEngine(build_hf_model(config, weights), tokenizer, max_new_tokens=new_tokens,
                                 temperature=1.0, record_routes=True)
        rollout = engine.generate(prompts, seed=3)
        batch = PolicyBatch.from_rollout(rollout, torch.where(rollout.response_mask, 0, -1), torch.ones(rows),
                                         pad_id=tokenizer.pad_token_id, route_layers=[0, 1])
        replayed, _ = forward_logprobs(trainer, batch, spec, layout, dp_group=None)
        own = compute_old_logprobs(trainer, replace(batch, routes=None), spec, layout, dp_group=None,
                                   record_routes=True)
        matching, counted = routing_agreement(own.routes, batch.routes, batch.loss_mask).tolist()
        mask = batch.loss_mask
        gap_own = (batch.rollout_logprobs - own.old_logprobs)[mask].abs().mean()
        gap_r3 = (batch.rollout_logprobs - replayed)[mask].abs().mean()
        print(f"engine={name} agreement={matching / counted:.4f} gap_own={float(gap_own):.3e} "
              f"gap_r3={float(gap_r3):.3e} ({int(mask.sum())} response tokens)")


def main() -> None:
    """Prints one line per learning rate, then one per engine (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per row (4 rows)")
    parser.add_argument("--rows", type=int, default=8, help="R3: sampled responses")
    parser.add_argument("--new-tokens", type=int, default=64, help="R3: tokens per response")
    args = parser.parse_args()
    config, state, tokenizer = load_hf_checkpoint("tiny-random-qwen3-moe")
    initialize_parallel(tp_size=1, pp_size=1, seed=0)
    try:
        ids = torch.randint(0, 50000, (4, args.tokens), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(ids.shape, dtype=torch.bool)
        old = build_policy_model(config).eval()
        load_hf_into_megatron(old, state, config)
        record_routes(old)
        old_logprobs = _logprobs(old, ids, config.vocab_size)
        routes = recorded_routes(old, *ids.shape)
        clear_routes(old)
        for lr in (1e-4, 1e-3, 1e-2):
            generator = torch.Generator().manual_seed(1)
            moved = {k: v + lr * torch.randn(v.shape, generator=generator) for k, v in state.items()}
            new = build_policy_model(config).eval()
            load_hf_into_megatron(new, moved, config)
            record_routes(new)
            own = _logprobs(new, ids, config.vocab_size)
            matching, counted = routing_agreement(recorded_routes(new, *ids.shape), routes, mask).tolist()
            replay_routes(new, routes)
            replayed = _logprobs(new, ids, config.vocab_size)
            clear_routes(new)
            print(f"lr={lr:.0e} agreement={matching / counted:.4f} "
                  f"ratio_gap_own={float((own - old_logprobs).abs().mean()):.3e} "
                  f"ratio_gap_r2={float((replayed - old_logprobs).abs().mean()):.3e}")
        _engine_vs_trainer(config, state, tokenizer, old, args.rows, args.new_tokens)
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()
