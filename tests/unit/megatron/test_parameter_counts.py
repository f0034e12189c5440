"""Per-rank parameter counts from a meta-device build (``nemo_sspo.megatron.parameter_counts``), by hand.

Kept apart from the mapping tests: the count builds its own TP = PP = 1 parallel state, so it must
run where no module fixture holds one. Real TP2 / PP2 builds are compared with the prediction in
``tests/distributed/test_qwen_parallel_mapping.py``.
"""

import pytest
from transformers import Qwen3Config

from nemo_sspo.megatron import parameter_counts
from nemo_sspo.models.published import published_config


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


def test_parameter_counts_of_qwen3_30b_a3b_match_its_model_card():
    # The published architecture --print-config uses without the checkpoint: 48 layers, hidden 2048,
    # 32 heads / 4 KV heads of head_dim 128, 128 experts of width 768, untied head, vocab 151,936.
    config = published_config("Qwen/Qwen3-30B-A3B")
    # Per layer, by hand: attention q 4096*2048 + k 512*2048 + v 512*2048 + o 2048*4096 = 18,874,368;
    # q/k norms 2*128; two norms 2*2048; router 128*2048 = 262,144; one expert 3*768*2048 = 4,718,592,
    # 128 of them 603,979,776 -> 623,120,640 per layer; x48 = 29,909,790,720. Embedding and untied
    # head 2*151,936*2048 = 622,329,856; final norm 2048 -> 30,532,122,624: the model card's "30.5B".
    (total,), = parameter_counts(config, tp_size=1, pp_size=1)
    assert total == 30_532_122_624
    # Active per token (8 of 128 experts): 29,909,790,720 - 48*120*4,718,592 = 2,730,700,800 in the
    # layers + 622,331,904 = 3,353,032,704: the card's "3.3B activated", which is also what one rank of
    # EP 16 holds (8 of the 128 experts of every layer, everything else replicated).
    assert parameter_counts(config, tp_size=1, pp_size=1, ep_size=16) == [[3_353_032_704]]
    # EP 4 x TP 2: experts 48*32*4,718,592 / 2 = 3,623,878,656; attention 48*18,874,368 / 2 = 452,984,832;
    # vocab 151,936 padded to 152,064 (multiple of 256): 2*76,032*2048 = 311,427,072; replicated norms and
    # routers 48*(256 + 4096 + 262,144) + 2048 = 12,793,856 -> 4,401,084,416 per rank.
    assert parameter_counts(config, tp_size=2, pp_size=1, ep_size=4) == [[4_401_084_416] * 2]
    with pytest.raises(ValueError, match="num_experts=128 is not divisible by ep_size=3"):
        parameter_counts(config, tp_size=1, pp_size=1, ep_size=3)
