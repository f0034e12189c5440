"""HF checkpoint sources: the tiny random Llama and the cached, dequantised SmolLM2-135M GGUF.

The SmolLM2 test reads the user cache (``$NEMO_SSPO_CACHE`` or ``~/.cache/nemo_sspo``); the very
first run builds it from the GGUF file (~30 s), later runs load it in well under a second.
"""

from pathlib import Path

import pytest
import torch

from nemo_sspo.models import SOURCES, build_hf_model, load_hf_checkpoint, load_hf_config

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-llama")


def test_tiny_config_fields(tiny):
    config, state_dict, tokenizer = tiny
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == len(tokenizer) == 49152
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in state_dict  # tied: the head is the embedding
    # 2 layers x 9 tensors (q, k, v, o, gate, up, down, 2 norms) + embedding + final norm = 20
    assert len(state_dict) == 20
    assert state_dict["model.embed_tokens.weight"].shape == (49152, 64)
    assert all(t.dtype == torch.float32 for t in state_dict.values())


def test_tiny_is_seeded_and_leaves_global_rng(tiny):
    torch.manual_seed(0)
    expected_next = torch.rand(3)
    torch.manual_seed(0)
    _, again, _ = load_hf_checkpoint("tiny-random-llama")
    assert torch.equal(torch.rand(3), expected_next)
    assert all(torch.equal(again[k], v) for k, v in tiny[1].items())


def test_tokenizer_pad_and_chat_template(tiny):
    tokenizer = tiny[2]
    # SmolLM2's tokenizer defines no pad token, so load_tokenizer pads with EOS (<|im_end|>, id 2).
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == tokenizer.eos_token and tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_source_lists_valid():
    with pytest.raises(ValueError, match="tiny-random-llama"):
        load_hf_checkpoint("gpt-5")
    assert set(SOURCES) == {"smollm2-135m-instruct", "tiny-random-llama", "tiny-random-qwen2",
                            "tiny-random-qwen3", "tiny-random-qwen3-moe"}


def test_cache_inside_repo_rejected():
    with pytest.raises(ValueError, match="inside the repository"):
        load_hf_checkpoint("tiny-random-llama", cache_dir=str(REPO / "cache"))


def test_build_rejects_bad_keys(tiny):
    config, state_dict, _ = tiny
    broken = {k: v for k, v in state_dict.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="model.norm.weight"):
        build_hf_model(config, broken)
    with pytest.raises(ValueError, match="unexpected"):
        build_hf_model(config, {**state_dict, "extra.weight": torch.zeros(1)})


def test_build_ties_head_to_embedding(tiny):
    model = build_hf_model(*tiny[:2])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not model.training


def test_smollm2_shapes_and_forward():
    config, state_dict, tokenizer = load_hf_checkpoint("smollm2-135m-instruct")
    assert type(config).__name__ == "LlamaConfig"
    assert (config.hidden_size, config.num_hidden_layers) == (576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    model = build_hf_model(config, state_dict)
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    # float64 reference: the same weights run in double precision. The float32 forward through 30
    # layers differs by 4e-5 at most (logits up to 27); atol 2e-4 leaves room for other CPUs'
    # kernels and fails on any overflow, NaN or precision loss in the float32 path.
    with torch.no_grad():
        reference = model.double()(input_ids=ids).logits
    torch.testing.assert_close(logits.double(), reference, atol=2e-4, rtol=0)
    # The dequantised weights are the real model's: it completes the sentence with "Paris".
    assert tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


def test_local_directory_source_round_trips(tmp_path, tiny):
    # A saved HF directory is a model source: same config, weights and tokenizer back.
    config, state_dict, tokenizer = tiny
    build_hf_model(config, state_dict).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded_config, loaded, loaded_tokenizer = load_hf_checkpoint(str(tmp_path))
    assert loaded_config.model_type == "llama" and set(loaded) == set(state_dict)
    assert all(torch.equal(loaded[k], v) for k, v in state_dict.items())
    assert loaded_tokenizer.eos_token == tokenizer.eos_token


def test_bad_directory_and_hub_id_messages(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="hub id"):
        load_hf_checkpoint("not a source")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        load_hf_checkpoint("Qwen/Qwen2.5-Math-1.5B")


def test_config_without_weights_is_the_checkpoints_config():
    source = "tiny-random-qwen3-moe"
    # load_hf_config (no weights: what --print-config and the load-time checks read) must give the
    # config load_hf_checkpoint builds with the weights (which also records their dtype);
    # tiny-random-qwen3-moe was once missing.
    without_dtype = [{k: v for k, v in config.to_dict().items() if k != "dtype"}
                     for config in (load_hf_config(source), load_hf_checkpoint(source)[0])]
    assert without_dtype[0] == without_dtype[1]
