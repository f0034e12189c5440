"""Process-group maths on tensor-parallel shards (no Megatron import).

``vocab_parallel_logprobs_entropy`` turns vocab-sharded logits ``[N, V_local]`` into per-token
log-probs and full-vocabulary entropies with two all-reduces per chunk of tokens and a
communication-free backward; ``vocab_shard_range`` gives a rank's global id range;
``reduce_metric_sums`` turns per-rank (sum, count) metrics into global means on every rank.
"""

from nemo_sspo.parallel.metrics import reduce_metric_sums
from nemo_sspo.parallel.vocab_parallel import vocab_parallel_logprobs_entropy, vocab_shard_range

__all__ = ["reduce_metric_sums", "vocab_parallel_logprobs_entropy", "vocab_shard_range"]
