"""Process-group maths on tensor-parallel shards and data-parallel batches (no Megatron import).

``vocab_parallel_logprobs_entropy`` turns vocab-sharded logits ``[N, V_local]`` into per-token
log-probs and full-vocabulary entropies with two all-reduces per chunk of tokens and a
communication-free backward; ``fused_linear_logprobs_entropy`` does the same from hidden states
and the output weight's vocab shard, one chunk of logits at a time; ``vocab_shard_range`` gives a rank's global id range;
``nemo_sspo.parallel.data_balance.balance_across_data_parallel`` moves rows between
data-parallel ranks so each computes about as many tokens;
``nemo_sspo.parallel.metric_reduce.reduce_metric_sums`` turns per-rank metric pairs
(:mod:`nemo_sspo.metrics`) into global means and extremes on every rank.
"""

from nemo_sspo.parallel.fused_output import fused_linear_logprobs_entropy
from nemo_sspo.parallel.vocab_parallel import vocab_parallel_logprobs_entropy, vocab_shard_range

__all__ = [
    "fused_linear_logprobs_entropy",
    "vocab_parallel_logprobs_entropy",
    "vocab_shard_range",
]
