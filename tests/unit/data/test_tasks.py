"""Prompt sources and templates: seeding, gold answers (re-derived independently), rendering."""

import json
import re

import pytest

from nemo_sspo.data import PROMPT_SOURCES, Problem, ShardedSource, build_prompt_source, render_prompt
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.rewards import MathVerifyReward

_START = re.compile(r"has (\d+) ")
_CHANGES = re.compile(r"buys (\d+) boxes with (\d+) |buys (\d+) more |gives (\d+) ")


def _solve(question: str) -> int:
    """Second algorithm: read the story back with regexes and redo the arithmetic."""
    total = int(_START.search(question).group(1))
    for boxes, each, more, given in _CHANGES.findall(question):
        if boxes:
            total += int(boxes) * int(each)
        elif more:
            total += int(more)
        else:
            total -= int(given)
    return total


@pytest.fixture(scope="module")
def tokenizer():
    return load_hf_checkpoint("smollm2-135m-instruct")[2]


def test_word_problems_seeded():
    first = build_prompt_source("word_problems", seed=3).sample(20)
    assert build_prompt_source("word_problems", seed=3).sample(20) == first
    assert build_prompt_source("word_problems", seed=4).sample(20) != first
    # A stream: the next draw continues, it does not restart.
    source = build_prompt_source("word_problems", seed=3)
    assert source.sample(5) + source.sample(15) == first


def test_word_problem_answers_are_right_numbers():
    problems = build_prompt_source("word_problems", seed=0, min_steps=1, max_steps=4,
                                   operations=["buy", "give", "boxes"], pool_size=None).sample(200)
    for p in problems:
        assert int(p.answer) == _solve(p.question) >= 0, p
        steps = len(_CHANGES.findall(p.question))
        assert 1 <= steps <= 4


def test_word_problem_operations_subset():
    # The default training task: two +/- changes, numbers <= 5; no multiplication step appears.
    problems = build_prompt_source("word_problems", seed=2, min_steps=2, max_steps=2, max_number=5,
                                   operations=["buy", "give"]).sample(100)
    for p in problems:
        assert "boxes" not in p.question and len(_CHANGES.findall(p.question)) == 2
        assert int(p.answer) == _solve(p.question) >= 0, p
    with pytest.raises(ValueError, match="operations"):
        build_prompt_source("word_problems", seed=0, operations=["divide"])


def test_word_problem_example_by_hand():
    # "X has a. ... buys k boxes with b ..." : check the solver itself on a hand-made story.
    story = "Tom has 8 marbles. He gives 3 marbles to a friend. Then he buys 2 boxes with 5 marbles each."
    assert _solve(story) == 15  # 8 - 3 + 2 * 5


def test_gold_answer_scores_one_when_boxed():
    problems = build_prompt_source("word_problems", seed=1).sample(6)
    with MathVerifyReward(num_workers=1) as reward:
        scores = reward([f"Step by step.\nSo the answer is \\boxed{{{p.answer}}}." for p in problems],
                        [p.answer for p in problems])
    assert scores == [1.0] * 6


def test_reasoning_gym_source_seeded_numeric():
    kwargs = dict(dataset="leg_counting", config=dict(min_animals=2, max_animals=2, max_instances=3))
    first = build_prompt_source("reasoning_gym", seed=5, **kwargs).sample(8)
    assert build_prompt_source("reasoning_gym", seed=5, **kwargs).sample(8) == first
    assert all(int(p.answer) >= 0 and "legs" in p.question for p in first)


def test_jsonl_source(tmp_path):
    path = tmp_path / "p.jsonl"
    records = [{"problem": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": 4}, {"problem": "3+3?", "answer": "6"}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    source = build_prompt_source("jsonl", seed=0, path=str(path))
    epoch = source.sample(3)
    assert sorted(epoch, key=lambda p: p.question) == [Problem("1+1?", "2"), Problem("2+2?", "4"), Problem("3+3?", "6")]
    assert len(set(source.sample(3))) == 3  # the next epoch again holds every record once
    assert build_prompt_source("jsonl", seed=0, path=str(path)).sample(3) == epoch


@pytest.mark.parametrize("line, fragment", [('{"question": "1+1", "answer": 2', "not valid JSON"),
                                            ("[1, 2]", "holds a list")])
def test_jsonl_malformed_line_names_file_and_line(tmp_path, line, fragment):
    path = tmp_path / "m.jsonl"
    path.write_text('{"question": "2+2", "answer": 4}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"m.jsonl:2 .*{fragment}|m.jsonl:2 {fragment}"):
        build_prompt_source("jsonl", seed=0, path=str(path))


def test_jsonl_bad_record(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "no keys"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        build_prompt_source("jsonl", seed=0, path=str(path))


def test_build_errors():
    with pytest.raises(ValueError, match="word_problems"):
        build_prompt_source("nope", seed=0)
    with pytest.raises(ValueError, match="bad options.*max_stepz"):
        build_prompt_source("word_problems", seed=0, max_stepz=3)
    with pytest.raises(ValueError, match="min_steps"):
        build_prompt_source("word_problems", seed=0, min_steps=3, max_steps=2)
    assert set(PROMPT_SOURCES) == {"word_problems", "reasoning_gym", "jsonl", "math"}


def test_qwen_math_template(tokenizer):
    # Qwen2.5-Math's "qwen25-math-cot" prompt: the instruction is the system message (ChatML).
    assert render_prompt(tokenizer, "What is {x}+1?", "qwen-math") == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
        "<|im_end|>\n<|im_start|>user\nWhat is {x}+1?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_boxed_template(tokenizer):
    text = render_prompt(tokenizer, "What is 1+1?", "chat-boxed")
    assert text.startswith("<|im_start|>system\nYou are a careful math tutor.")
    assert text.endswith("<|im_start|>user\nWhat is 1+1?\nSolve it step by step, one step per line. "
                         "Put the final answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")


def test_chat_cot_template_on_the_qwen_tokenizer():
    # One user turn with Qwen2.5-Math's instruction, no system turn (the R1-Distill / Qwen3 cards' math
    # prompt), through the Qwen tokenizer's own chat template.
    qwen = load_hf_checkpoint("tiny-random-qwen3")[2]
    assert render_prompt(qwen, "What is 1+1?", "chat-cot") == (
        "<|im_start|>user\nWhat is 1+1?\nPlease reason step by step, and put your final answer within "
        "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_template(tokenizer):
    with pytest.raises(ValueError, match="chat-boxed"):
        render_prompt(tokenizer, "q", "alpaca")


def test_shards_of_a_stream_are_disjoint_and_hold_all_of_it():
    # 3 shards of identically seeded streams, drawn at different paces (2 + 2, 4, 1 + 3 problems):
    # shard j's k-th problem is the stream's problem 3k + j, so together they are its first 12.
    stream = build_prompt_source("word_problems", seed=5).sample(12)
    shards = [ShardedSource(build_prompt_source("word_problems", seed=5), index=j, count=3) for j in range(3)]
    drawn = [shards[0].sample(2) + shards[0].sample(2), shards[1].sample(4), shards[2].sample(1) + shards[2].sample(3)]
    for j, problems in enumerate(drawn):
        assert problems == stream[j::3]
    with pytest.raises(ValueError, match=r"shard index=3 of count=3"):
        ShardedSource(stream, index=3, count=3)


def test_a_bad_data_line_names_the_path_key_as_the_trainer_reports_it(tmp_path):
    # the trainer builds the source under at_key("data.options.", ...): the key, then file:line
    from nemo_sspo.trainer.config import at_key

    path = tmp_path / "bad_line.jsonl"
    path.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": "4"}\n{"problem": \n')
    with pytest.raises(ValueError, match=f"^data.options.path='{path}': bad_line.jsonl:3 is not valid JSON"):
        at_key("data.options.", lambda: build_prompt_source("jsonl", seed=0, path=str(path)))
