"""Evaluation: greedy Avg@1 on the paper's math benchmarks (MATH-500, AMC, AIME24, Minerva,
OlympiadBench) with math-verify, on a transformers (CPU) or vLLM (GPU) engine.

The trainer calls :func:`evaluate` every ``eval.every_n_steps`` steps; ``nemo-sspo eval`` calls it
once on a checkpoint.
"""

from nemo_sspo.evaluation.benchmark import MEAN_KEY, as_eval_engine, evaluate, metric_key
from nemo_sspo.evaluation.greedy_engines import EvalEngine, TransformersEvalEngine, VLLMEvalEngine, stop_token_ids

__all__ = [
    "MEAN_KEY",
    "EvalEngine",
    "TransformersEvalEngine",
    "VLLMEvalEngine",
    "as_eval_engine",
    "evaluate",
    "metric_key",
    "stop_token_ids",
]
