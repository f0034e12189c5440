"""Prompt data: seeded problem sources, the paper's math datasets, and prompt templates."""

from nemo_sspo.data.math_datasets import (
    MATH_DATASETS,
    PAPER_BENCHMARKS,
    MathRecord,
    load_math_dataset,
    resolve_data_dir,
)
from nemo_sspo.data.tasks import (
    PROMPT_SOURCES,
    SOURCE_OPTIONS,
    Problem,
    PromptSource,
    ShardedSource,
    build_prompt_source,
)
from nemo_sspo.data.templates import TEMPLATES, render_prompt

__all__ = [
    "MATH_DATASETS",
    "PAPER_BENCHMARKS",
    "PROMPT_SOURCES",
    "SOURCE_OPTIONS",
    "TEMPLATES",
    "MathRecord",
    "Problem",
    "PromptSource",
    "ShardedSource",
    "build_prompt_source",
    "load_math_dataset",
    "render_prompt",
    "resolve_data_dir",
]
