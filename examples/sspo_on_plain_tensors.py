"""Plugging the SSPO loss into any GRPO loop: plain tensors in, a scalar loss out (no Megatron).

    python examples/sspo_on_plain_tensors.py

Two responses of one prompt; response 0 has two line-break segments, response 1 one. The old
policy's log-probs are perturbed so the ratios differ from 1 and the entropy-adaptive clip acts.
"""

import torch

from nemo_sspo.algorithms import aggregate, build_boundary_table, get_policy_loss, group_advantages, newline_segment_ids
from nemo_sspo.parallel import reduce_metric_sums


class _ToyTokenizer:
    """Five-token vocabulary; id 2 decodes to '.\\n' and so closes a segment."""

    texts = ["a", "b", ".\n", "c", "<eos>"]

    def __len__(self):
        return len(self.texts)

    def decode(self, ids):
        return "".join(self.texts[i] for i in ids)


def main() -> None:
    boundary = build_boundary_table(_ToyTokenizer())
    response_ids = torch.tensor([[0, 1, 2, 3, 4], [0, 3, 4, 0, 0]])
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    segments = newline_segment_ids(response_ids, response_mask, boundary)
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0]), group_size=2)

    logprobs = torch.full((2, 5), -1.0, requires_grad=True)
    old_logprobs = torch.tensor([[-1.5, -1.2, -0.9, -1.0, -1.1], [-0.8, -1.0, -1.3, 0.0, 0.0]])
    old_entropy = torch.full((2, 5), 0.6)

    loss_fn, config_cls = get_policy_loss("sspo")
    per_token, metrics = loss_fn(logprobs, old_logprobs, advantages, response_mask, segments, old_entropy,
                                 config_cls())
    numerator, denominator = aggregate(per_token, response_mask, "seq-mean-token-mean")
    loss = numerator / denominator
    loss.backward()
    print("segment ids:\n", segments)
    print("advantages:", advantages.tolist())
    print(f"loss = {loss.item():.4f}")
    print("d loss / d logprobs:\n", logprobs.grad)
    # One process: no groups; the same call the trainer makes (handles _min/_max pairs, adds _std).
    summary = reduce_metric_sums(metrics, dp_group=None, pp_group=None, last_stage_rank=0, is_last_stage=True)
    print({k: round(v, 4) for k, v in summary.items()})


if __name__ == "__main__":
    main()
