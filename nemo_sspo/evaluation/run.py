"""``nemo-sspo eval``: score one checkpoint on the configured benchmarks and write the results."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from nemo_sspo.data import load_math_dataset
from nemo_sspo.evaluation.benchmark import MEAN_KEY, evaluate, metric_key
from nemo_sspo.evaluation.greedy_engines import EvalEngine, TransformersEvalEngine, VLLMEvalEngine
from nemo_sspo.rewards import MathVerifyOptions, MathVerifyReward

__all__ = ["build_eval_engine", "format_results", "run_eval"]


def build_eval_engine(cfg) -> tuple[EvalEngine, Any]:
    """``(engine, tokenizer)`` for ``cfg.model.source`` on the ``cfg.rollout.engine.backend`` backend.

    ``hf``: the checkpoint is loaded on CPU (fp32) into a transformers model. ``vllm``: vLLM loads
    the model directory itself (the vllm engine's options, ``cfg.rollout.engine.options``); only the tokenizer is read here.

    Raises:
        ValueError: as ``resolve_model_dir`` and ``load_hf_checkpoint``.
    """
    from nemo_sspo.models import SOURCES, build_hf_model, load_hf_checkpoint
    from nemo_sspo.models.hf_checkpoint import engine_model_dir, load_tokenizer, resolve_model_dir
    from nemo_sspo.models.hf_folder import stop_token_ids

    if cfg.rollout.engine.backend == "vllm":
        model_dir = engine_model_dir(cfg.model.source, cache_dir=cfg.model.cache_dir)
        tokenizer = load_tokenizer(model_dir)
        engine = VLLMEvalEngine(str(model_dir), stop_token_ids=stop_token_ids(tokenizer, model_dir),
                                seed=cfg.trainer.seed, **dataclasses.asdict(cfg.rollout.engine.options))
        return engine, tokenizer
    hf_config, state_dict, tokenizer = load_hf_checkpoint(cfg.model.source, cache_dir=cfg.model.cache_dir)
    model = build_hf_model(hf_config, state_dict)
    model_dir = resolve_model_dir(cfg.model.source) if cfg.model.source not in SOURCES else None
    return TransformersEvalEngine(model, tokenizer, batch_size=cfg.eval.batch_size,
                                  stop_token_ids=stop_token_ids(tokenizer, model_dir)), tokenizer


def format_results(results: dict[str, float], counts: dict[str, int]) -> str:
    """A plain-text table: benchmark, problems scored, Avg@1 in percent, and the mean row."""
    lines = [f"{'benchmark':<16}{'problems':>9}{'Avg@1 %':>10}"]
    for name, count in counts.items():
        lines.append(f"{name:<16}{count:>9}{100 * results[metric_key(name)]:>10.2f}")
    lines.append(f"{'mean':<16}{'':>9}{100 * results[MEAN_KEY]:>10.2f}")
    return "\n".join(lines)


def run_eval(cfg) -> dict[str, float]:
    """Evaluate ``cfg.model.source`` on ``cfg.eval.benchmarks``; writes ``results.json`` and
    ``samples.jsonl`` under ``cfg.eval.output_dir`` and returns :func:`evaluate`'s dict.

    The prompt template is ``cfg.data.template`` (the one the model was trained with).

    ``cfg`` is a validated config (``nemo_sspo.cli.load_config``).

    Raises:
        ValueError: a missing data directory or benchmark file (both checked before the model is
            loaded), or as :func:`build_eval_engine` and :func:`evaluate`.
    """
    ev = cfg.eval
    counts = {name: len(load_math_dataset(name, ev.data_dir, key="eval.data_dir")[:ev.limit_per_benchmark])
              for name in ev.benchmarks}
    engine, tokenizer = build_eval_engine(cfg)
    out = Path(ev.output_dir)
    # Scored by math-verify whatever the run's reward: its options, or their defaults for another reward.
    options = cfg.reward.options if isinstance(cfg.reward.options, MathVerifyOptions) else MathVerifyOptions()
    with MathVerifyReward(num_workers=options.num_workers, timeout_s=options.timeout_s) as reward:
        results = evaluate(engine, tokenizer, ev.benchmarks, data_dir=ev.data_dir, data_dir_key="eval.data_dir", limit=ev.limit_per_benchmark,
                           max_new_tokens=ev.max_new_tokens, template=cfg.data.template, reward=reward,
                           samples_path=out / "samples.jsonl")
    summary = {"results": results, "problems": counts, "model_source": cfg.model.source,
               "template": cfg.data.template, "max_new_tokens": ev.max_new_tokens,
               "backend": cfg.rollout.engine.backend, "decoding": "greedy"}
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_results(results, counts))
    return results
