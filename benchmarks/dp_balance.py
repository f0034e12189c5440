"""Straggler work with and without token balancing across data-parallel ranks (no model, no timing).

The paper's batch shape: 128 prompts x 8 responses of up to 3,000 tokens after a ~200-token prompt.
Each data-parallel rank rolls out its own prompts, so response lengths are correlated within a
rank's groups (a hard prompt gives 8 long answers). The step waits for the rank with the most work;
per rank the work counted here is what the token-budget layout computes: the sum over its
micro-batches of rows x longest row (``MicroBatchLayout(max_tokens=...)``), i.e. tokens including the
padding it keeps. Printed per DP size: the most-loaded rank's tokens over the mean (1.0 is perfect
balance) without and with ``balance_across_data_parallel``'s partition, and as the last line
``straggler_ratio=<balanced max / unbalanced max>`` at DP=8, averaged over seeds.

    python benchmarks/dp_balance.py [--seeds 20]
"""

from __future__ import annotations

import argparse

import torch

from nemo_sspo.algorithms.batch import PolicyBatch
from nemo_sspo.algorithms.micro_batches import MicroBatchLayout, balanced_partition

PROMPTS, SAMPLES, CAP, PROMPT_TOKENS, BUDGET = 128, 8, 3000, 200, 8192


def _lengths(seed: int) -> torch.Tensor:
    """[PROMPTS * SAMPLES] prompt + response tokens: a log-normal difficulty per prompt, then
    per-response noise; most responses short, a few at the cap."""
    gen = torch.Generator().manual_seed(seed)
    difficulty = torch.exp(torch.randn(PROMPTS, generator=gen) * 0.8) * 500
    noise = torch.exp(torch.randn(PROMPTS, SAMPLES, generator=gen) * 0.4)
    responses = (difficulty[:, None] * noise).clamp(1, CAP).round().long()
    return responses.flatten() + PROMPT_TOKENS


def _computed_tokens(lengths: list[int]) -> int:
    """Tokens the token-budget layout computes for rows of these lengths (padding included)."""
    width = max(lengths)
    batch = PolicyBatch(input_ids=torch.zeros(len(lengths), width, dtype=torch.long),
                        position_ids=torch.zeros(len(lengths), width, dtype=torch.long),
                        targets=torch.zeros(len(lengths), width, dtype=torch.long),
                        loss_mask=torch.zeros(len(lengths), width, dtype=torch.bool),
                        segment_ids=torch.zeros(len(lengths), width, dtype=torch.long),
                        old_logprobs=torch.zeros(len(lengths), width),
                        old_entropy=torch.zeros(len(lengths), width),
                        advantages=torch.zeros(len(lengths)), lengths=torch.tensor(lengths))
    return sum(m.input_ids.numel() for m in MicroBatchLayout(max_tokens=BUDGET).plan(batch))


def _imbalance(lengths: torch.Tensor, dp: int, balance: bool) -> tuple[float, int]:
    """(max / mean of the ranks' computed tokens, max) for one step at data-parallel size ``dp``."""
    rows = lengths.tolist()
    per_rank = len(rows) // dp
    if balance:
        parts = [[rows[i] for i in part] for part in balanced_partition(rows, dp)]
    else:
        parts = [rows[r * per_rank:(r + 1) * per_rank] for r in range(dp)]
    work = [_computed_tokens(part) for part in parts]
    return max(work) / (sum(work) / dp), max(work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    print(f"{'DP':>3} | {'max/mean unbalanced':>20} | {'max/mean balanced':>18} | {'max balanced / max unbalanced':>30}")
    ratio = 1.0
    for dp in (2, 4, 8):
        before, after, ratios = [], [], []
        for seed in range(args.seeds):
            lengths = _lengths(seed)
            (imb_b, max_b), (imb_a, max_a) = _imbalance(lengths, dp, False), _imbalance(lengths, dp, True)
            before.append(imb_b)
            after.append(imb_a)
            ratios.append(max_a / max_b)
        ratio = sum(ratios) / len(ratios)
        print(f"{dp:>3} | {sum(before) / len(before):>20.3f} | {sum(after) / len(after):>18.3f} | {ratio:>30.3f}")
    print(f"straggler_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
