"""Prompt sources: seeded streams of ``Problem(question, answer)`` for GRPO rollouts.

Sources (``build_prompt_source(name, seed=..., **options)``; each source's options and their
defaults are one dataclass, :data:`SOURCE_OPTIONS`, which the config layer also uses as the schema
of ``data.options``):

- ``"word_problems"`` (default): procedurally generated multi-step arithmetic word problems about
  everyday items ("Mia has 7 pencils. She buys 3 boxes with 4 pencils each. ..."); one operation per
  sentence, so a worked solution naturally takes one line per step. Integer answers >= 0.
- ``"reasoning_gym"``: any reasoning-gym 0.1.25 dataset by name (``dataset="leg_counting"``,
  ``"chain_sum"``, ...) with its config fields in ``config``; seeded by reasoning-gym itself.
- ``"jsonl"``: records ``{"problem" | "question": ..., "answer": ...}`` from ``path``, shuffled
  with the seed and cycled (e.g. ``gsm8k_test.jsonl`` from ``nemo-sspo data prepare``).
- ``"math"``: one of the paper's datasets by name (``dataset="math_train"`` for the MATH level 3-5
  training set, ``"math500"``, ...; :data:`nemo_sspo.data.math_datasets.MATH_DATASETS`) from
  ``data_dir`` (or ``$NEMO_SSPO_DATA_DIR``), shuffled with the seed and cycled.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from nemo_sspo.data.jsonl import jsonl_lines
from nemo_sspo.data.math_datasets import load_math_dataset

__all__ = [
    "PROMPT_SOURCES",
    "SOURCE_OPTIONS",
    "JsonlOptions",
    "MathOptions",
    "Problem",
    "PromptSource",
    "ReasoningGymOptions",
    "ShardedSource",
    "WordProblemOptions",
    "build_prompt_source",
]


@dataclass(frozen=True)
class Problem:
    """One task: the question text and its gold answer (a string math-verify can parse)."""

    question: str
    answer: str


class PromptSource(Protocol):
    """An endless, seeded stream of problems."""

    def sample(self, n: int) -> list[Problem]:
        """The next ``n`` problems (same seed -> same sequence)."""
        ...


class ShardedSource:
    """Shard ``index`` of ``count`` of a prompt source: its problems ``index``, ``index + count``,
    ``index + 2 count``, ... (ours).

    ``count`` shards of identically seeded sources are disjoint and together hold the whole stream,
    so generators that draw at their own pace (free-running rollout ranks) never share a problem
    unless the stream itself repeats it.

    Args:
        source: the stream to shard (it is drawn ``count`` problems per problem returned).
        index: this shard, 0 <= index < count.
        count: shards, >= 1 (1 is the stream itself).

    Raises:
        ValueError: ``count < 1`` or ``index`` outside ``[0, count)``.
    """

    def __init__(self, source: PromptSource, *, index: int, count: int) -> None:  # noqa: D107
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"shard index={index} of count={count}: need count >= 1 and 0 <= index < count")
        self.source, self.index, self.count = source, index, count

    def sample(self, n: int) -> list[Problem]:
        """The shard's next ``n`` problems."""
        return self.source.sample(n * self.count)[self.index::self.count]


_NAMES = [("Mia", "she"), ("Tom", "he"), ("Ava", "she"), ("Leo", "he"), ("Zoe", "she"), ("Sam", "he"),
          ("Lily", "she"), ("Ben", "he"), ("Emma", "she"), ("Noah", "he")]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "cards", "shells", "stamps"]


@dataclass
class WordProblemOptions:
    """Options of the ``word_problems`` source (arguments of :class:`WordProblemSource`).

    The defaults are the CPU demo's training set, sized for SmolLM2-135M-Instruct: with the
    ``chat-boxed`` template at temperature 0.7 it answers ~9% of 1-2 step +/- problems with numbers
    <= 5 right (94% of responses boxed, ~45 tokens, 3-4 lines): if independent, 1 - 0.91^8 = 55% of
    groups of 8 hold a rewarded sample.
    """

    min_steps: int = 1
    """Fewest changes to the starting amount (>= 1)."""
    max_steps: int = 2
    """Most changes (>= min_steps)."""
    max_number: int = 5
    """Largest number drawn for an amount (>= 2); box counts are 2..4."""
    operations: list[str] = field(default_factory=lambda: ["buy", "give"])
    """Change kinds to draw from, a non-empty subset of buy, give, boxes (boxes adds a multiplication)."""
    pool_size: int | None = 8
    """N >= 1: generate N problems once and serve them in epochs (reshuffled each epoch), so early and
    late steps are measured on the same problems; None: a fresh problem for every prompt."""

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming the option that is out of range."""
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"min_steps={self.min_steps} must be in [1, max_steps={self.max_steps}]")
        if self.max_number < 2:
            raise ValueError(f"max_number={self.max_number} must be >= 2")
        if not self.operations or set(self.operations) - set(WordProblemSource.OPERATIONS):
            raise ValueError(f"operations={list(self.operations)} must be a non-empty subset of "
                             f"{WordProblemSource.OPERATIONS}")
        if self.pool_size is not None and self.pool_size < 1:
            raise ValueError(f"pool_size={self.pool_size} must be >= 1 (or None for fresh problems)")


@dataclass
class ReasoningGymOptions:
    """Options of the ``reasoning_gym`` source."""

    dataset: str
    """reasoning-gym dataset name (e.g. ``leg_counting``); required."""
    config: dict[str, Any] = field(default_factory=dict)
    """That dataset's config fields (e.g. ``min_animals: 2``)."""


@dataclass
class JsonlOptions:
    """Options of the ``jsonl`` source."""

    path: str
    """JSON-lines file of ``{"problem" | "question": ..., "answer": ...}`` records; required."""


@dataclass
class MathOptions:
    """Options of the ``math`` source."""

    dataset: str = "math_train"
    """A name of :data:`nemo_sspo.data.math_datasets.MATH_DATASETS` (the paper's MATH level 3-5 set)."""
    data_dir: str | None = None
    """Folder of the JSONL files; None reads ``$NEMO_SSPO_DATA_DIR``."""


class WordProblemSource:
    """Seeded multi-step word problems: a starting amount, then ``steps`` changes to it.

    Each change is one of: buys ``b`` more (+b), gives ``b`` away (-b, never below 0), buys ``k``
    boxes of ``b`` each (+k*b). Example (2 steps): "Tom has 8 marbles. He gives 3 marbles to a
    friend. Then he buys 2 boxes with 5 marbles each. How many marbles does Tom have now?" -> "15".

    Args:
        seed: RNG seed.
        min_steps, max_steps, max_number, operations, pool_size: as :class:`WordProblemOptions`,
            which checks their ranges (build the source with :func:`build_prompt_source`).
    """

    OPERATIONS = ("buy", "give", "boxes")

    def __init__(self, *, seed: int, min_steps: int, max_steps: int, max_number: int,
                 operations: Sequence[str], pool_size: int | None) -> None:
        self._operations = list(operations)
        self._rng = random.Random(seed)
        self._steps = (min_steps, max_steps)
        self._max = max_number
        self._pool = None
        if pool_size is not None:
            self._pool = _ShuffledSource([self._one() for _ in range(pool_size)], seed)

    def sample(self, n: int) -> list[Problem]:
        if self._pool is not None:
            return self._pool.sample(n)
        return [self._one() for _ in range(n)]

    def _one(self) -> Problem:
        rng = self._rng
        name, pronoun = rng.choice(_NAMES)
        item = rng.choice(_ITEMS)
        total = rng.randint(2, self._max)
        sentences = [f"{name} has {total} {item}."]
        for step in range(rng.randint(*self._steps)):
            predicate, total = self._change(total, item)
            subject = f"Then {pronoun}" if step else pronoun.capitalize()
            sentences.append(f"{subject} {predicate}")
        sentences.append(f"How many {item} does {name} have now?")
        return Problem(question=" ".join(sentences), answer=str(total))

    def _change(self, total: int, item: str) -> tuple[str, int]:
        """One change as a verb phrase, and the new total."""
        rng = self._rng
        kinds = [k for k in self._operations if k != "give" or total > 1]
        kind = rng.choice(kinds or ["buy"])  # "give" alone with 1 item left: buy instead
        if kind == "give":
            b = rng.randint(1, total - 1)
            return f"gives {b} {item} to a friend.", total - b
        b = rng.randint(2, self._max)
        if kind == "buy":
            return f"buys {b} more {item}.", total + b
        k = rng.randint(2, 4)
        return f"buys {k} boxes with {b} {item} each.", total + k * b


class ReasoningGymSource:
    """A reasoning-gym dataset as a stream: items ``0, 1, 2, ...`` of a seeded procedural dataset.

    Args:
        dataset: reasoning-gym dataset name (e.g. ``"leg_counting"``).
        seed: dataset seed; item ``i`` depends only on ``(seed, i)``.
        config: that dataset's config fields (e.g. ``{"min_animals": 2}``).
    """

    _SIZE = 1_000_000  # virtual size: items are generated on access

    def __init__(self, *, dataset: str, seed: int, config: dict[str, Any]) -> None:
        import reasoning_gym

        self._data = reasoning_gym.create_dataset(dataset, seed=seed, size=self._SIZE, **config)
        self._next = 0

    def sample(self, n: int) -> list[Problem]:
        items = [self._data[(self._next + i) % self._SIZE] for i in range(n)]
        self._next += n
        return [Problem(question=item["question"], answer=str(item["answer"])) for item in items]


class _ShuffledSource:
    """A fixed list of problems drawn without replacement, reshuffled (seeded) every epoch."""

    def __init__(self, problems: list[Problem], seed: int) -> None:
        self._problems = problems
        self._rng = random.Random(seed)
        self._order: list[int] = []

    def sample(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            if not self._order:
                self._order = self._rng.sample(range(len(self._problems)), len(self._problems))
            out.append(self._problems[self._order.pop()])
        return out


class JsonlSource(_ShuffledSource):
    """Problems from a JSONL file (``problem`` or ``question`` key, plus ``answer``), shuffled per epoch.

    Raises:
        ValueError: a missing file, an empty file, a line that is not a JSON object (names file and
            line), or a record without the needed keys.
    """

    def __init__(self, *, path: str, seed: int) -> None:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"path={path!r} is not a file; give a JSONL file of problems")
        problems = [_record_to_problem(line, file, i)
                    for i, line in jsonl_lines(file.read_text(encoding="utf-8"))]
        if not problems:
            raise ValueError(f"path={path!r} holds no records")
        super().__init__(problems, seed)


class MathDatasetSource(_ShuffledSource):
    """A named math dataset (e.g. ``"math_train"``, 8,521 problems with a gold answer), shuffled per epoch.

    Args:
        dataset: a name of :data:`nemo_sspo.data.math_datasets.MATH_DATASETS`.
        seed: shuffling seed.
        data_dir: folder of the JSONL files; None reads ``$NEMO_SSPO_DATA_DIR``.

    Raises:
        ValueError: unknown dataset or missing data directory/file (naming ``data_dir``).
    """

    def __init__(self, *, dataset: str, seed: int, data_dir: str | None) -> None:
        records = load_math_dataset(dataset, data_dir)
        super().__init__([Problem(question=r.problem, answer=r.answer) for r in records], seed)


def _record_to_problem(text: str, file: Path, line: int) -> Problem:
    where = f"path={str(file)!r}: {file.name}:{line}"  # the argument, then the line as an editor opens it
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not valid JSON ({err.msg}); one JSON object per line") from err
    if not isinstance(record, dict):
        raise ValueError(f"{where} holds a {type(record).__name__}; each line must be a JSON object")
    question = record.get("problem", record.get("question"))
    if question is None or "answer" not in record:
        raise ValueError(f"{where} needs a 'problem' or 'question' key and an 'answer' key")
    return Problem(question=str(question), answer=str(record["answer"]))


PROMPT_SOURCES = {"word_problems": WordProblemSource, "reasoning_gym": ReasoningGymSource, "jsonl": JsonlSource,
                  "math": MathDatasetSource}
"""Name -> source class for :func:`build_prompt_source`."""

SOURCE_OPTIONS = {"word_problems": WordProblemOptions, "reasoning_gym": ReasoningGymOptions, "jsonl": JsonlOptions,
                  "math": MathOptions}
"""Name -> options dataclass of that source (the one place its defaults live)."""


def build_prompt_source(name: str, *, seed: int, **options) -> PromptSource:
    """Construct the prompt source ``name`` (see the module docstring) with ``seed``; options not
    given take the defaults of ``SOURCE_OPTIONS[name]``.

    Raises:
        ValueError: unknown ``name`` (lists the valid ones), an option the source does not have or
            a required one missing (names it), or an option out of range (names it).
    """
    if name not in PROMPT_SOURCES:
        raise ValueError(f"prompt source {name!r} is unknown; valid: {', '.join(PROMPT_SOURCES)}")
    try:
        resolved = SOURCE_OPTIONS[name](**options)
    except TypeError as err:  # an unexpected keyword, or a required one missing
        raise ValueError(f"bad options for prompt source {name!r}: {err}") from err
    return PROMPT_SOURCES[name](seed=seed, **asdict(resolved))
