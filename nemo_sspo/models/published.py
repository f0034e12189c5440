"""The published architectures of the hub models the shipped recipes name, for checks without the weights.

``nemo-sspo train --print-config`` counts each rank's parameters from the model built on the meta
device; that needs the model's config, which a machine without the checkpoint in its Hugging Face
cache does not have. These are the architecture fields of each model's ``config.json`` on the hub
(values read from the model cards' configs; the table and its layout are ours). They are used only
when the checkpoint itself is not found: a local copy always wins.
"""

from __future__ import annotations

from transformers import PretrainedConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

__all__ = ["PUBLISHED_ARCHITECTURES", "published_config"]

_QWEN = dict(rms_norm_eps=1e-6, hidden_act="silu")
# Qwen2.5-Math-1.5B's layers, which DeepSeek-R1-Distill-Qwen-1.5B (distilled from it) keeps; the
# two configs differ in head tying and context length.
_QWEN25_1_5B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    vocab_size=151936, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **_QWEN)
PUBLISHED_ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "Qwen/Qwen2.5-Math-1.5B": (Qwen2Config, dict(_QWEN25_1_5B, tie_word_embeddings=True,
                                                 max_position_embeddings=4096)),
    "Qwen/Qwen2.5-Math-7B": (Qwen2Config, dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **_QWEN)),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": (Qwen2Config, dict(_QWEN25_1_5B, tie_word_embeddings=False,
                                                                    max_position_embeddings=131072)),
    "Qwen/Qwen3-8B": (Qwen3Config, dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **_QWEN)),
    "Qwen/Qwen3-30B-A3B": (Qwen3MoeConfig, dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.001, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **_QWEN)),
}
"""Hub id -> (config class, architecture fields of its published ``config.json``)."""


def published_config(source: str) -> PretrainedConfig | None:
    """The published architecture of hub id ``source`` (no weights, no download), or None if not listed.

    Args:
        source: a hub id as ``model.source`` names it, e.g. ``Qwen/Qwen3-30B-A3B``.

    Returns:
        A config of the model's class with the fields of :data:`PUBLISHED_ARCHITECTURES`.
    """
    entry = PUBLISHED_ARCHITECTURES.get(source)
    if entry is None:
        return None
    config_class, fields = entry
    return config_class(**fields)
