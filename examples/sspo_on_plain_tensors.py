"""Plugging the SSPO loss into any GRPO loop: plain tensors in, a scalar loss out (no Megatron).

    python examples/sspo_on_plain_tensors.py

Two responses of one prompt; response 0 has two line-break segments, response 1 one. The old
policy's log-probs are perturbed so the ratios differ from 1 and the entropy-adaptive clip acts.
``compute_policy_loss`` applies the loss's own aggregation (SSPO: each response weighs the same;
DAPO: each token), so switching the name switches the reduction too.
"""

import torch

from nemo_sspo import LossInputs, compute_policy_loss
from nemo_sspo.algorithms import build_segment_tables, group_advantages, segment_ids


class _ToyTokenizer:
    """Five-token vocabulary; id 2 decodes to '.\\n' and so closes a segment."""

    texts = ["a", "b", ".\n", "c", "<eos>"]

    def __len__(self):
        return len(self.texts)

    def decode(self, ids):
        return "".join(self.texts[i] for i in ids)


def main() -> None:
    tables = build_segment_tables(_ToyTokenizer())  # once per tokenizer
    response_ids = torch.tensor([[0, 1, 2, 3, 4], [0, 3, 4, 0, 0]])
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    segments = segment_ids("newline", response_ids, response_mask, tables)
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0]), samples_per_prompt=2)

    logprobs = torch.full((2, 5), -1.0, requires_grad=True)
    old_logprobs = torch.tensor([[-1.5, -1.2, -0.9, -1.0, -1.1], [-0.8, -1.0, -1.3, 0.0, 0.0]])
    old_entropy = torch.full((2, 5), 0.6)

    inputs = LossInputs(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                        response_mask=response_mask, segment_ids=segments, old_entropy=old_entropy)
    loss, metrics = compute_policy_loss("sspo", inputs)  # the paper's 1.5B bounds; e.g. gamma=2.2
    loss.backward()
    print("segment ids:\n", segments)
    print("advantages:", advantages.tolist())
    print(f"loss = {loss.item():.4f}")
    print("d loss / d logprobs:\n", logprobs.grad)
    print({k: round(v, 4) for k, v in metrics.items() if k.startswith(("loss/", "policy/clipfrac_"))})


if __name__ == "__main__":
    main()
