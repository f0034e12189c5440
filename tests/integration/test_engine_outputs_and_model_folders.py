"""A run from a model folder whose generation config declares more end ids than its tokenizer
(Llama-3 style), failing at step 2 on a NaN log-prob from the rollout engine.

Two properties at once (issue 19, items 2 and 4): the engine's NaN is refused where it enters, naming
the engine, row and token position, and the completed step is kept (metrics.jsonl, best/,
hf_checkpoint_interrupted); and every model folder the run writes (best/, hf_checkpoint_interrupted,
hf_checkpoint) holds the source's whole stop list, not only the tokenizer's EOS.
"""

import json

import pytest
from transformers import GenerationConfig

from nemo_sspo.megatron import destroy_parallel
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.rollout import HFRolloutEngine
from nemo_sspo.trainer.checkpoint import write_hf_checkpoint
from tests.integration._loop_runs import make_trainer

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)

# SmolLM2's tokenizer: EOS <|im_end|> 2, <|endoftext|> 0. The folder's generation config adds 17 and 23,
# as Llama-3's [128001, 128008, 128009] adds <|eom_id|> and <|eot_id|> to the tokenizer's 128001.
SOURCE_EOS = [2, 17, 23]
STOP_LIST = [0, 2, 17, 23]  # the tokenizer's 0 and 2 plus the folder's 17 and 23, sorted


def _source_folder(tmp_path):
    config, state, tokenizer = load_hf_checkpoint("tiny-random-llama")
    folder = write_hf_checkpoint(tmp_path / "source", config, state, tokenizer, stop_ids=[0, 2])
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": SOURCE_EOS}))
    return folder


def _stub_benchmark(folder):
    folder.mkdir()
    rows = [{"id": str(i), "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(2)]
    (folder / "math500.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_engine_nan_stops_the_step_and_every_written_folder_keeps_the_stop_list(monkeypatch, tmp_path):
    sampled = HFRolloutEngine._sampled_logprobs
    calls = {"n": 0}

    def nan_in_step_2(scores, response_ids):  # one generate call per prompt group, 2 groups per step
        logprobs = sampled(scores, response_ids)
        calls["n"] += 1
        if calls["n"] == 3:
            logprobs[1, 0] = float("nan")
        return logprobs

    monkeypatch.setattr(HFRolloutEngine, "_sampled_logprobs", staticmethod(nan_in_step_2))
    out = tmp_path / "run"
    trainer = make_trainer(monkeypatch, out, [
        f"model.source={_source_folder(tmp_path)}", "trainer.max_steps=3", "trainer.save_hf_checkpoint=true",
        "eval.every_n_steps=1", "eval.benchmarks=[math500]", "eval.limit_per_benchmark=2", "eval.max_new_tokens=4",
        f"eval.data_dir={_stub_benchmark(tmp_path / 'data')}"])
    try:
        assert trainer.stop_ids == STOP_LIST and trainer.engine.stop_token_ids == STOP_LIST
        with pytest.raises(ValueError, match=r"rollout engine 'hf' returned log-prob nan for token id \d+ at "
                                             r"row 1, response position 0"):
            trainer.fit()
        trainer.folders.save("hf_checkpoint", trainer.model.module, trainer.groups.mp_src_rank)  # the writer fit() calls after the last step
    finally:
        destroy_parallel()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]  # the completed step is kept
    # On main hf_checkpoint_interrupted held [0, 2] (the tokenizer's ids only).
    for name in ("best", "hf_checkpoint_interrupted", "hf_checkpoint"):
        assert GenerationConfig.from_pretrained(out / name).eos_token_id == STOP_LIST, name
