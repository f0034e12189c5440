"""Evaluation: the math-verify scorer on hand-written answers, Avg@1 arithmetic, engines, CLI path.

The scorer cases cover each benchmark's gold-answer style (README of the data folder): MATH LaTeX
(fractions, radicals, tuples, sets), AMC floats ("27.0"), AIME zero padding ("025"), OlympiadBench
"$...$" delimiters and percentages, Minerva's "3.83e35". Every correct case has a near miss that
must score 0, so a scorer that accepts everything fails as surely as one that rejects everything.
"""

import json
import sys
from pathlib import Path

import pytest

from nemo_sspo.cli import load_config, main
from nemo_sspo.evaluation import MEAN_KEY, VLLMEvalEngine, evaluate, metric_key
from nemo_sspo.evaluation.run import run_eval
from nemo_sspo.rewards import MathVerifyReward

SCORER_CASES = [
    # (response, gold answer, expected score)
    ("so the answer is \\boxed{\\frac{14}{3}}.", "\\frac{14}{3}", 1.0),
    ("\\boxed{4.6667}", "\\frac{14}{3}", 0.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{2}", "2\\sqrt{2}", 0.0),  # a bare parse of the gold would read "2\sqrt{2}" as 2
    ("\\boxed{(3, -1)}", "(3,-1)", 1.0),
    ("\\boxed{(-1, 3)}", "(3,-1)", 0.0),
    ("\\boxed{1, 2}", "1,2", 1.0),
    ("\\boxed{1.2}", "1,2", 0.0),  # a bare parse of the gold would read "1,2" as 1.2
    ("\\boxed{(x+5)(x+2)}", "x^2+7x+10", 1.0),
    ("\\boxed{27}", "27.0", 1.0),  # AMC golds are float literals
    ("\\boxed{28}", "27.0", 0.0),
    ("\\boxed{25}", "025", 1.0),  # AIME golds keep their leading zeros
    ("\\boxed{2^{1009}}", "$2^{1009}$", 1.0),  # OlympiadBench golds may carry $...$
    ("\\boxed{2^{1008}}", "$2^{1009}$", 0.0),
    ("\\boxed{17.5\\%}", "17.5%", 1.0),
    ("\\boxed{18\\%}", "17.5%", 0.0),
    ("\\boxed{3.83\\times 10^{35}}", "3.83e35", 1.0),  # Minerva's scientific literal
    ("\\boxed{3.9\\times 10^{35}}", "3.83e35", 0.0),
    ("The answer is 5.", "5", 0.0),  # no \boxed{}: nothing to grade
    ("first \\boxed{4}, then corrected: \\boxed{5}", "5", 1.0),  # the last box counts
]


@pytest.fixture(scope="module")
def reward():
    with MathVerifyReward(num_workers=2, timeout_s=5.0) as pool:
        yield pool


def test_scorer_on_hand_written_answers(reward):
    responses, answers, expected = zip(*SCORER_CASES)
    assert reward(list(responses), list(answers)) == list(expected)


def _write(path: Path, rows: list[tuple[str, str]], source: str) -> None:
    path.write_text("".join(json.dumps({"id": f"{source}/{i}", "problem": p, "answer": a, "source": source}) + "\n"
                            for i, (p, a) in enumerate(rows)))


class _CannedEngine:
    """Answers each prompt from a fixed table (problem text -> response); records its calls."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table, self.calls = table, []

    def generate_greedy(self, prompts, max_new_tokens):
        self.calls.append((len(prompts), max_new_tokens))
        return [next(resp for problem, resp in self.table.items() if problem in prompt) for prompt in prompts]


@pytest.fixture()
def data_dir(tmp_path):
    _write(tmp_path / "math500.jsonl", [("Compute 1/2 + 1/6.", "\\frac{2}{3}"), ("What is 3*3?", "9"),
                                        ("Simplify sqrt(8).", "2\\sqrt{2}")], "math500")
    _write(tmp_path / "aime24.jsonl", [("Find N.", "025"), ("Find M.", "100")], "aime24")
    return tmp_path


def test_avg_at_1_per_benchmark_and_mean(data_dir, reward, tmp_path):
    engine = _CannedEngine({"1/2 + 1/6": "\\boxed{\\frac{4}{6}}", "3*3": "\\boxed{6}", "sqrt(8)": "\\boxed{2\\sqrt2}",
                            "Find N": "\\boxed{25}", "Find M": "no box"})
    samples = tmp_path / "out" / "samples.jsonl"
    with pytest.warns(UserWarning, match="sha256"):  # these files are not the published copies
        results = evaluate(engine, None, ["math500", "aime24"], data_dir=str(data_dir), max_new_tokens=17,
                           reward=reward, samples_path=samples)
    # math500: 2 of 3 right (4/6 == 2/3, 2\sqrt2 == 2\sqrt{2}; 6 != 9); aime24: 1 of 2 (25 == 025).
    assert results == pytest.approx({metric_key("math500"): 2 / 3, metric_key("aime24"): 1 / 2,
                                     MEAN_KEY: (2 / 3 + 1 / 2) / 2})
    assert list(results) == ["eval/math500", "eval/aime24", "eval/mean"]
    assert engine.calls == [(3, 17), (2, 17)]  # one batch per benchmark, the length cap passed on
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(r["benchmark"], r["correct"]) for r in rows] == [
        ("math500", 1.0), ("math500", 0.0), ("math500", 1.0), ("aime24", 1.0), ("aime24", 0.0)]


def test_limit_takes_the_first_problems_in_file_order(data_dir, reward):
    engine = _CannedEngine({"1/2 + 1/6": "\\boxed{2/3}", "3*3": "\\boxed{9}", "sqrt(8)": "\\boxed{0}",
                            "Find N": "\\boxed{1}", "Find M": "\\boxed{1}"})
    with pytest.warns(UserWarning):
        results = evaluate(engine, None, ["math500"], data_dir=str(data_dir), limit=2, reward=reward)
    assert results[metric_key("math500")] == 1.0  # the wrong third answer is outside the subset


def test_evaluate_errors_name_their_arguments(data_dir, monkeypatch):
    # The function names its own arguments; a caller passes how its user spells data_dir.
    monkeypatch.delenv("NEMO_SSPO_DATA_DIR", raising=False)
    engine = _CannedEngine({})
    with pytest.raises(ValueError, match="^data_dir is not set"):
        evaluate(engine, None, ["math500"])
    with pytest.raises(ValueError, match="eval.data_dir is not set"):
        evaluate(engine, None, ["math500"], data_dir_key="eval.data_dir")
    with pytest.raises(ValueError, match="^limit=0"):
        evaluate(engine, None, ["math500"], data_dir=str(data_dir), limit=0)
    with pytest.raises(ValueError, match="valid: math_train"):
        evaluate(engine, None, ["gsm9k"], data_dir=str(data_dir))
    with pytest.raises(ValueError, match="cannot evaluate a str"):
        evaluate("a model", None, ["math500"], data_dir=str(data_dir))


def test_vllm_engine_missing_package_names_the_backend_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ValueError, match="rollout.engine.backend='vllm' needs the package vllm"):
        VLLMEvalEngine("/models/qwen")


def test_eval_command_path_on_a_tiny_model(data_dir, tmp_path, capsys):
    # The `nemo-sspo eval` body (config -> engine -> evaluate -> files) on the tiny random Llama.
    out = tmp_path / "eval"
    cfg = load_config(overrides=["model=tiny_random", "data.template=qwen-math", f"eval.data_dir={data_dir}",
                                 "eval.benchmarks=[math500,aime24]", "eval.limit_per_benchmark=2",
                                 "eval.max_new_tokens=4", "reward.options.num_workers=1", f"eval.output_dir={out}"])
    with pytest.warns(UserWarning):
        results = run_eval(cfg)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    # The tiny random model's greedy 4-token responses hold no \boxed{} (checked here), and a
    # response without one scores 0 (SCORER_CASES, "The answer is 5."): every sample scores 0, so
    # each benchmark's Avg@1 and their mean are 0.
    assert len(samples) == 4 and not any("\\boxed" in row["response"] for row in samples)
    assert [row["correct"] for row in samples] == [0.0] * 4
    assert results == {"eval/math500": 0.0, "eval/aime24": 0.0, "eval/mean": 0.0}
    summary = json.loads((out / "results.json").read_text())
    assert summary["problems"] == {"math500": 2, "aime24": 2} and summary["decoding"] == "greedy"
    assert summary["results"] == results
    assert "mean" in capsys.readouterr().out


def test_eval_subcommand_reports_bad_settings_with_their_key(capsys):
    assert main(["eval", "eval.limit_per_benchmark=0"]) == 2
    assert "eval.limit_per_benchmark must be >= 1" in capsys.readouterr().err
    assert main(["eval", "eval.benchmarks=[math500,gsm9k]"]) == 2
    assert "eval.benchmarks has unknown names ['gsm9k']" in capsys.readouterr().err


def test_exported_stop_token_ids_is_the_model_stop_list():
    # nemo_sspo.evaluation.stop_token_ids used to raise NameError (a stale copy read an undefined
    # list). A tokenizer with EOS 2 and "<|im_end|>" at 7: the stop list is [2, 7].
    from nemo_sspo.evaluation import stop_token_ids

    class _Tokenizer:
        eos_token_id = 2

        def get_vocab(self):
            return {"a": 0, "<|im_end|>": 7, "b": 9}

    assert stop_token_ids(_Tokenizer()) == [2, 7]
