r"""Greedy Avg@1 on the paper's math benchmarks, scored by math-verify.

Avg@1 with greedy decoding is the fraction of a benchmark's problems whose single greedy response
has a last ``\boxed{}`` answer that math-verify finds equal to the gold answer
(:func:`nemo_sspo.rewards.score_response`). The summary ``eval/mean`` is the unweighted mean over
the benchmarks (each benchmark weighs the same, as in the paper's "Avg." column).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

from nemo_sspo.data.jsonl import jsonl_line
from nemo_sspo.data import PAPER_BENCHMARKS, MathRecord, load_math_dataset, render_prompt
from nemo_sspo.evaluation.greedy_engines import EvalEngine, TransformersEvalEngine, VLLMEvalEngine
from nemo_sspo.rewards import MathVerifyReward

__all__ = ["as_eval_engine", "evaluate", "metric_key", "MEAN_KEY"]

_LOG = logging.getLogger(__name__)

MEAN_KEY = "eval/mean"
"""Key of the mean over benchmarks in :func:`evaluate`'s result."""


def metric_key(benchmark: str) -> str:
    """``"eval/<benchmark>"``: the key of one benchmark's Avg@1 in :func:`evaluate`'s result."""
    return f"eval/{benchmark}"


def as_eval_engine(model_or_engine: Any, tokenizer, batch_size: int = 8) -> EvalEngine:
    """An :class:`EvalEngine` for an engine, a transformers model, or an object holding one.

    Accepts anything with ``generate_greedy`` (returned as is), a rollout engine holding a vLLM
    ``LLM`` as ``.llm`` (the trainer's ``VLLMRolloutEngine``: wrapped in :class:`VLLMEvalEngine`), a
    transformers ``PreTrainedModel`` (wrapped in :class:`TransformersEvalEngine`), or an object whose
    ``.model`` is one (e.g. the trainer's ``HFRolloutEngine``). Rollout engines are evaluated with
    their current, refitted weights, and stop at the rollout engine's stop list.

    Raises:
        ValueError: none of these.
    """
    from transformers import PreTrainedModel

    if hasattr(model_or_engine, "generate_greedy"):
        return model_or_engine
    stop_ids = getattr(model_or_engine, "stop_token_ids", None)  # a rollout engine's stop list
    if hasattr(model_or_engine, "llm"):
        return VLLMEvalEngine(model_or_engine.llm, stop_token_ids=stop_ids)
    model = getattr(model_or_engine, "model", model_or_engine)
    if isinstance(model, PreTrainedModel):
        return TransformersEvalEngine(model, tokenizer, batch_size=batch_size, stop_token_ids=stop_ids)
    raise ValueError(
        f"cannot evaluate a {type(model_or_engine).__name__}: pass an EvalEngine (TransformersEvalEngine, "
        "VLLMEvalEngine), a transformers PreTrainedModel, or an object with such a .model"
    )


def evaluate(
    model_or_engine: Any,
    tokenizer,
    benchmarks: Sequence[str] = PAPER_BENCHMARKS,
    *,
    data_dir: str | None = None,
    data_dir_key: str = "data_dir",
    limit: int | None = None,
    max_new_tokens: int = 3000,
    template: str = "qwen-math",
    batch_size: int = 8,
    reward: MathVerifyReward | None = None,
    samples_path: str | Path | None = None,
) -> dict[str, float]:
    """Greedy Avg@1 per benchmark and their mean.

    Args:
        model_or_engine: see :func:`as_eval_engine` (an ``HFRolloutEngine``, a transformers model,
            a ``TransformersEvalEngine`` or a ``VLLMEvalEngine``). Call it on one process only
            (e.g. global rank 0); it does no collective communication.
        tokenizer: the model's tokenizer (for rendering templates and the transformers backend).
        benchmarks: names in ``nemo_sspo.data.MATH_DATASETS`` (default: the paper's five).
        data_dir: folder of the JSONL files; None reads ``$NEMO_SSPO_DATA_DIR``.
        data_dir_key: how the caller's user spells ``data_dir`` (``eval.data_dir`` in the YAML), for
            the messages.
        limit: score only the first ``limit`` problems of each benchmark, in file order (the same
            subset every time); None scores all.
        max_new_tokens: greedy response length cap (the paper: 3,000).
        template: prompt template name (``nemo_sspo.data.TEMPLATES``), as used for training.
        batch_size: prompts per generate call with the transformers backend.
        reward: a :class:`MathVerifyReward` pool to score with (e.g. the trainer's); None starts
            one with 2 workers and closes it afterwards.
        samples_path: if given, one JSON line per problem is written there
            (``benchmark, id, answer, response, correct``).

    Returns:
        ``{"eval/<benchmark>": Avg@1 in [0, 1] for each benchmark, "eval/mean": their mean}``,
        plain floats, benchmark keys in the given order.

    Raises:
        ValueError: an empty benchmark list, ``limit < 1``, an unknown benchmark or template,
            or a missing data directory/file (naming ``data_dir_key``).
    """
    if not benchmarks:
        raise ValueError("benchmarks is empty; name at least one benchmark")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1, or None for every problem")
    engine = as_eval_engine(model_or_engine, tokenizer, batch_size)
    sets = {name: load_math_dataset(name, data_dir, key=data_dir_key)[:limit] for name in benchmarks}
    own_reward = reward is None
    reward = MathVerifyReward(num_workers=2) if own_reward else reward
    rows: list[dict[str, Any]] = []
    results: dict[str, float] = {}
    try:
        for name, records in sets.items():
            start = time.perf_counter()
            scores, responses = _score_benchmark(engine, tokenizer, records, reward, max_new_tokens, template)
            results[metric_key(name)] = sum(scores) / len(scores)
            _LOG.info("eval %s: %d/%d correct (%.1f%%) in %.0f s", name, int(sum(scores)), len(scores),
                      100 * results[metric_key(name)], time.perf_counter() - start)
            rows += [{"benchmark": name, "id": r.id, "answer": r.answer, "response": text, "correct": score}
                     for r, text, score in zip(records, responses, scores, strict=True)]
    finally:
        if own_reward:
            reward.close()
    results[MEAN_KEY] = sum(results.values()) / len(results)
    if samples_path is not None:
        _write_jsonl(Path(samples_path), rows)
    return results


def _score_benchmark(engine: EvalEngine, tokenizer, records: list[MathRecord], reward: MathVerifyReward,
                     max_new_tokens: int, template: str) -> tuple[list[float], list[str]]:
    prompts = [render_prompt(tokenizer, r.problem, template) for r in records]
    responses = engine.generate_greedy(prompts, max_new_tokens)
    if len(responses) != len(prompts):
        raise ValueError(f"the eval engine returned {len(responses)} responses for {len(prompts)} prompts")
    return reward(responses, [r.answer for r in records]), responses


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(jsonl_line(row))
