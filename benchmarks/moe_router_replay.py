"""How much an update moves MoE routes, and what router replay R2 changes (no timing).

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

    python benchmarks/moe_router_replay.py [--tokens 512]
"""

from __future__ import annotations

import argparse

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
from nemo_sspo.models import load_hf_checkpoint


def _logprobs(model, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, S-1] log-probs of the next tokens."""
    with torch.no_grad():
        logits = forward_logits(model, ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :vocab]
    return torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def main() -> None:
    """Prints one line per learning rate (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per row (4 rows)")
    args = parser.parse_args()
    config, state, _ = load_hf_checkpoint("tiny-random-qwen3-moe")
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
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()
