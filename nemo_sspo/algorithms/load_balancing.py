"""The auxiliary load-balancing loss of mixture-of-experts routers, as Hugging Face Qwen3-MoE computes it.

Source: transformers' ``load_balancing_loss_func`` (``models/qwen3_moe/modeling_qwen3_moe.py``,
transformers 5.x), the Switch Transformer loss (Fedus et al., arXiv 2101.03961, eqs. 4-6) with top-k
assignments and the statistics of all MoE layers pooled. With router logits ``z[l, n]`` of layer
``l`` and token ``n``, ``p[l, n] = softmax(z[l, n])`` over the E experts, ``c[l, n, e] = 1`` when
expert ``e`` is one of the token's k experts in that layer, and the valid (non-padding) tokens
``n`` only, ``R = L * N_valid`` rows:

    f_e = (1 / R) * sum_{l, n} c[l, n, e]          (assignments per row; sum_e f_e = k)
    P_e = (1 / R) * sum_{l, n} p[l, n, e]          (mean router probability)
    aux = E * sum_e f_e * P_e

HF adds ``router_aux_loss_coef * aux`` to the language-model loss when asked for router logits.
Megatron-Core's ``aux_loss`` load balancing differs: it computes the loss per layer, divides by k and
sums the layers, while HF pools the layers before the product (so ``f_e`` of one layer multiplies
``P_e`` of another). The gradient flows through ``p`` only; the assignment counts are constants.
"""

from __future__ import annotations

import torch

__all__ = ["load_balancing_loss"]


def load_balancing_loss(router_logits: torch.Tensor, routing_map: torch.Tensor,
                        token_mask: torch.Tensor) -> torch.Tensor:
    """HF Qwen3-MoE's load-balancing loss of one forward (module docstring), without its coefficient.

    Args:
        router_logits: ``[L, N, E]`` float router logits of the L MoE layers for the same N tokens.
        routing_map: ``[L, N, E]`` bool, True for the k experts each token went to in each layer (the
            top-k of ``softmax(router_logits)``, or the experts replayed in their place).
        token_mask: ``[N]`` bool, the tokens counted (HF's attention mask: prompt and response
            tokens, not padding).

    Returns:
        0-d float32 ``aux`` (>= 0; k when the load is perfectly even, up to ``k * E`` when every
        token goes to the same experts); 0 when no token is counted.

    Raises:
        ValueError: shapes that do not agree.
    """
    if router_logits.dim() != 3 or routing_map.shape != router_logits.shape or token_mask.shape != router_logits.shape[1:2]:
        raise ValueError(f"router_logits {tuple(router_logits.shape)}, routing_map {tuple(routing_map.shape)} "
                         f"and token_mask {tuple(token_mask.shape)} must be [L, N, E], [L, N, E] and [N]")
    layers, _, experts = router_logits.shape
    weight = token_mask.to(torch.float32)[None, :, None]  # [1, N, 1]
    rows = layers * weight.sum()
    if rows == 0:
        return router_logits.new_zeros((), dtype=torch.float32)
    probs = torch.softmax(router_logits.float(), dim=-1)
    assignments = (routing_map.float() * weight).sum(dim=(0, 1)) / rows  # f_e [E]
    mean_probs = (probs * weight).sum(dim=(0, 1)) / rows  # P_e [E]
    return experts * (assignments * mean_probs).sum()
