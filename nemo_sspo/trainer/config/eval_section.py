"""``eval``: benchmarks and their greedy decoding, with the section's own invariants."""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_sspo.data import MATH_DATASETS, PAPER_BENCHMARKS
from nemo_sspo.trainer.config.keyed import failed

__all__ = ["EvalConfig"]


@dataclass
class EvalConfig:
    """``eval``: benchmarks and their greedy decoding."""

    benchmarks: list[str] = field(default_factory=lambda: list(PAPER_BENCHMARKS))
    """Datasets scored by greedy Avg@1 (names of ``nemo_sspo.data.MATH_DATASETS``); the paper's five by default."""
    data_dir: str | None = None
    """Folder of the benchmark JSONL files; null = ``$NEMO_SSPO_DATA_DIR`` (docs/data.md)."""
    limit_per_benchmark: int | None = None
    """Score only the first N problems of each benchmark (CPU smoke runs); null = all."""
    max_new_tokens: int = 3000
    """Greedy response length cap in tokens (the paper's 3,000)."""
    batch_size: int = 8
    """Prompts per ``generate`` call with the transformers backend."""
    every_n_steps: int = 0
    """Trainer: evaluate every N steps and keep the best step (the paper uses 10); 0 = never."""
    output_dir: str = "outputs/eval"
    """``nemo-sspo eval`` writes results.json and samples.jsonl here."""

    def problems(self, key: str) -> list[str]:
        """Benchmark names and the sizes of the evaluation.

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        unknown = [name for name in self.benchmarks if name not in MATH_DATASETS]
        return failed(
            (bool(self.benchmarks) and not unknown,
             f"{key}.benchmarks has unknown names {unknown} (or is empty); valid: {', '.join(MATH_DATASETS)}"),
            (self.limit_per_benchmark is None or self.limit_per_benchmark >= 1,
             f"{key}.limit_per_benchmark must be >= 1, or null for every problem"),
            (self.max_new_tokens >= 1, f"{key}.max_new_tokens must be >= 1"),
            (self.batch_size >= 1, f"{key}.batch_size must be >= 1"),
            (self.every_n_steps >= 0, f"{key}.every_n_steps must be >= 0 (0 disables evaluation during training)"),
        )
