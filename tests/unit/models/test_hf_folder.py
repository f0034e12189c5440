"""Hugging Face folders we write load everywhere (no GGUF quantization_config, architectures set,
generation config with the stop list), and one stop list drives the HF rollout engine."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nemo_sspo.models import build_hf_model, default_cache_root, load_hf_checkpoint
from nemo_sspo.models.hf_checkpoint import engine_model_dir
from nemo_sspo.models.hf_folder import clean_hf_config, generation_eos_ids, repair_config_file, stop_token_ids
from nemo_sspo.rollout import HFRolloutEngine
from nemo_sspo.trainer.checkpoint import write_hf_checkpoint


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-llama")


def test_stop_lists_of_the_shipped_tokenizers(tiny, tmp_path):
    assert stop_token_ids(tiny[2]) == [0, 2]  # SmolLM2: <|endoftext|> 0, <|im_end|> 2 (its EOS)
    qwen = load_hf_checkpoint("tiny-random-qwen2")[2]
    assert stop_token_ids(qwen) == [151643, 151645]  # Qwen2.5: <|endoftext|>, <|im_end|> (its EOS)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert generation_eos_ids(tmp_path) == [9] and stop_token_ids(qwen, tmp_path) == [9, 151643, 151645]


def test_clean_config_drops_gguf_quantization_and_names_the_architecture(tiny):
    config = tiny[0]
    config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    cleaned = clean_hf_config(config, torch.float32)
    assert not hasattr(cleaned, "quantization_config") and cleaned.architectures == ["LlamaForCausalLM"]
    assert hasattr(config, "quantization_config")  # the caller's config is not changed
    del config.quantization_config


def test_stale_cache_config_is_repaired(tmp_path):
    stale = {"model_type": "llama", "quantization_config": {"quant_method": "gguf"}, "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(stale))
    assert repair_config_file(tmp_path)
    fixed = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in fixed and fixed["architectures"] == ["LlamaForCausalLM"]
    assert fixed["hidden_size"] == 8 and not repair_config_file(tmp_path)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("writer", ["write_hf_checkpoint", "engine_model_dir"])
def test_written_folders_load_in_transformers_with_the_same_weights(tiny, tmp_path, writer):
    config, state_dict, tokenizer = tiny
    config.quantization_config = {"quant_method": "gguf"}  # as the GGUF-derived SmolLM2 config had
    try:
        if writer == "write_hf_checkpoint":
            folder = write_hf_checkpoint(tmp_path / "hf_checkpoint", config, state_dict, tokenizer,
                                         stop_ids=stop_token_ids(tokenizer))
        else:
            # a cache root of its own, sharing the SmolLM2 tokenizer files (no 30 s GGUF conversion)
            (tmp_path / "smollm2-135m-instruct").symlink_to(default_cache_root() / "smollm2-135m-instruct")
            folder = engine_model_dir("tiny-random-llama", cache_dir=str(tmp_path))
    finally:
        del config.quantization_config
    written = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in written and written["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    assert AutoConfig.from_pretrained(folder).architectures == ["LlamaForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 200]])
    torch.testing.assert_close(_logits(loaded, ids), _logits(build_hf_model(config, state_dict), ids), rtol=0, atol=0)


def test_hf_engine_stops_at_any_id_of_the_stop_list(tiny):
    # Script the stop: sample once, then make row 0's first sampled token a stop id. With the same
    # seed and weights the same token is sampled, and the response must end right there.
    config, state_dict, tokenizer = tiny
    model = build_hf_model(config, state_dict)
    prompts = ["Tom has 3 apples.", "Tom has 3 apples."]
    free = HFRolloutEngine(model, tokenizer, max_new_tokens=6, temperature=1.0).generate(prompts, seed=11)
    first = int(free.response_ids[0, 0])
    assert first not in (0, 2) and free.truncated.tolist() == [True, True]  # no natural stop in 6 tokens
    stopped = HFRolloutEngine(model, tokenizer, max_new_tokens=6, temperature=1.0,
                              stop_token_ids=[2, first]).generate(prompts, seed=11)
    assert stopped.response_ids[0, 0] == first and stopped.response_mask[0].tolist()[:2] == [True, False]
    assert not stopped.truncated[0]
    # Row 1 stops at its first occurrence of `first` (if any), else runs to max_new_tokens.
    row1 = free.response_ids[1].tolist()
    end = row1.index(first) + 1 if first in row1 else 6
    assert stopped.response_mask[1].sum().item() == end and bool(stopped.truncated[1]) == (first not in row1)
