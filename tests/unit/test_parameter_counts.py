"""Per-rank parameter counts from a meta-device build (``nemo_sspo.megatron.parameter_counts``), by hand.

Kept apart from the mapping tests: the count builds its own TP = PP = 1 parallel state, so it must
run where no module fixture holds one. Real TP2 / PP2 builds are compared with the prediction in
``tests/distributed/test_qwen_parallel_mapping.py``.
"""

import pytest
from transformers import Qwen3Config

from nemo_sspo.megatron import parameter_counts


def test_parameter_counts_of_qwen3_8b_by_hand():
    # Qwen3-8B's published architecture, built on the meta device (no memory). By hand, per layer:
    # q 4096*4096 + k 1024*4096 + v 1024*4096 + o 4096*4096 = 41,943,040; q/k norms 2*128;
    # MLP 3*12288*4096 = 150,994,944; two norms 2*4096 -> 192,946,432; x36 = 6,946,071,552.
    # Embedding and untied head 2*151,936*4096 = 1,244,659,712; final norm 4096 -> 8,190,735,360.
    config = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                         tie_word_embeddings=False, max_position_embeddings=40960,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    assert parameter_counts(config, tp_size=1, pp_size=1) == [[8_190_735_360]]
    # TP=4: the vocabulary is padded to a multiple of 128*4: 151,936 -> 152,064 rows, 38,016 per
    # rank, so embedding + head = 2*38,016*4096 = 311,427,072 per rank. The 36*(2*128 + 2*4096) + 4096
    # = 308,224 norm weights are replicated; the other 8,190,735,360 - 1,244,659,712 - 308,224 =
    # 6,945,767,424 are split in four: 1,736,441,856 per rank.
    assert parameter_counts(config, tp_size=4, pp_size=1) == [[1_736_441_856 + 311_427_072 + 308_224] * 4]
    with pytest.raises(ValueError, match="tp_size=16 does not divide the model.s num_key_value_heads=8"):
        parameter_counts(config, tp_size=16, pp_size=1)
