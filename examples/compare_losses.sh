#!/usr/bin/env bash
# Same seed, same data, four policy losses: SSPO, SSPO without the entropy clip, GSPO and GRPO.
# Each run writes outputs/compare/<loss>/metrics.jsonl; compare reward/mean and policy/clipfrac_*.
set -euo pipefail
cd "$(dirname "$0")/.."
for loss in sspo sspo_fixed_clip gspo grpo; do
  .venv/bin/nemo-sspo train loss=$loss trainer.output_dir=outputs/compare/$loss "$@"
done
