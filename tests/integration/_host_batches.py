"""Synthetic rollout batches and full-vocabulary references for the host-adapter tests.

One global batch of ``ROWS`` sequences (``PROMPT`` prompt tokens, then responses of different
lengths, right-padded), vocab-parallel logits over a padded vocabulary (the padding columns hold a
large value that would dominate if it leaked), and a toy tokenizer whose ids in ``NEWLINE_IDS``
decode with a newline. Everything is float64 and seeded, so every rank builds the same tensors.
"""

from __future__ import annotations

import torch

from nemo_sspo.algorithms.aggregation import aggregate
from nemo_sspo.algorithms.losses import LossInputs, make_policy_loss
from nemo_sspo.algorithms.segmentation import build_segment_tables, segment_ids

ROWS, PROMPT, LENGTH = 8, 3, 11
VOCAB, VOCAB_PADDED = 37, 40
NEWLINE_IDS = (5, 9, 20)
RESPONSE_LENGTHS = (8, 1, 5, 8, 3, 7, 2, 6)


class ToyTokenizer:
    """``len()`` and ``decode([id])``: all this tokenizer-facing code reads."""

    def __len__(self) -> int:
        return VOCAB

    def decode(self, ids) -> str:
        return "t\n" if ids[0] in NEWLINE_IDS else f"t{ids[0]}"


def tables():
    return build_segment_tables(ToyTokenizer())


def global_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Target-frame tensors ([B, S - 1]) plus ids and logits; old policy = logits + noise."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=gen)
    ids[:, PROMPT:][torch.rand(ROWS, LENGTH - PROMPT, generator=gen) < 0.3] = NEWLINE_IDS[0]
    position = torch.arange(LENGTH - 1)
    lengths = torch.tensor(RESPONSE_LENGTHS)
    # target t predicts ids[:, t + 1]: response targets are t in [PROMPT - 1, PROMPT - 1 + len).
    mask = (position >= PROMPT - 1) & (position < PROMPT - 1 + lengths[:, None])
    logits = 2.0 * torch.randn(ROWS, LENGTH, VOCAB_PADDED, generator=gen, dtype=torch.float64)
    logits[..., VOCAB:] = 25.0
    logprobs, entropy = full_vocab_logprobs_entropy(logits, ids)
    old = logprobs + 0.6 * torch.randn(ROWS, LENGTH - 1, generator=gen, dtype=torch.float64)
    advantages = torch.randn(ROWS, generator=gen, dtype=torch.float64)
    old_entropy = entropy * (0.3 + torch.rand(ROWS, LENGTH - 1, generator=gen,
                                              dtype=torch.float64)) * 0.4
    return {"ids": ids, "mask": mask, "logits": logits, "old_logprobs": torch.where(mask, old, 0),
            "advantages": advantages, "old_entropy": torch.where(mask, old_entropy, 0)}


def full_vocab_logprobs_entropy(logits, ids):
    """float64 log-probs of ids[:, 1:] and entropies over the true vocabulary, [B, S - 1]."""
    logp = torch.log_softmax(logits[:, :-1, :VOCAB].to(torch.float64), dim=-1)
    logprobs = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logprobs, -(logp.exp() * logp).sum(-1)


def native_loss(loss_name, config, batch, rows, mask=None):
    """Our loss on full-vocabulary logits for ``rows``: (numerator, denominator, grad wrt logits)."""
    logits = batch["logits"][rows].clone().requires_grad_(True)
    ids = batch["ids"][rows]
    mask = batch["mask"][rows] if mask is None else mask
    logprobs, _ = full_vocab_logprobs_entropy(logits, ids)
    loss = make_policy_loss(loss_name, config)
    needs = loss.requirements  # the ratio unit: the loss's fixed one or the config's segmentation
    segments = segment_ids(needs.segmentation, ids[:, 1:], mask, tables(), k=needs.segment_k)
    out = loss(LossInputs(logprobs=logprobs, old_logprobs=batch["old_logprobs"][rows],
                          advantages=batch["advantages"][rows], response_mask=mask,
                          segment_ids=segments, old_entropy=batch["old_entropy"][rows]))
    per_token, metrics = out.per_token_loss, out.metrics
    num, den = aggregate(per_token, mask, config.aggregation)
    return num, den, logits, metrics
