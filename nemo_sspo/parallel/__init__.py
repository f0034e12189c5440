"""Process-group maths on tensor-parallel shards (no Megatron import).

``vocab_parallel_logprobs_entropy`` turns vocab-sharded logits ``[N, V_local]`` into per-token
log-probs and full-vocabulary entropies with two all-reduces per chunk of tokens and a
communication-free backward; ``vocab_shard_range`` gives a rank's global id range.
"""

from nemo_sspo.parallel.vocab_parallel import vocab_parallel_logprobs_entropy, vocab_shard_range

__all__ = ["vocab_parallel_logprobs_entropy", "vocab_shard_range"]
