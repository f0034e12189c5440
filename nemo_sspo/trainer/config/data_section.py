"""``data``: the prompt source, its options and the prompt template, with the section's own invariants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_sspo.data import SOURCE_OPTIONS, TEMPLATES
from nemo_sspo.data.tasks import WordProblemOptions
from nemo_sspo.trainer.config.keyed import failed

__all__ = ["DataConfig"]


@dataclass
class DataConfig:
    """``data``: the prompt source, its options and the prompt template."""

    source: str = "word_problems"
    """Prompt source name (``nemo_sspo.data.build_prompt_source``)."""
    template: str = "chat-boxed"
    """Prompt template name (``nemo_sspo.data.render_prompt``)."""
    options: Any = field(default_factory=WordProblemOptions)
    """The source's options dataclass (``nemo_sspo.data.SOURCE_OPTIONS``): select the source as a group
    (``data=jsonl``) so that its schema applies, then set fields (``data.options.path=...``)."""

    def problems(self, key: str) -> list[str]:
        """The source and template names, and the options' type against the source.

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        known = self.source in SOURCE_OPTIONS
        return failed(
            (known, f"{key}.source={self.source!r} is unknown; valid: {', '.join(SOURCE_OPTIONS)}"),
            (not known or type(self.options) is SOURCE_OPTIONS[self.source],
             f"{key}.source={self.source!r} needs {key}.options of type "
             f"{SOURCE_OPTIONS[self.source].__name__ if known else None}, got {type(self.options).__name__}: "
             f"select the source as a group (data={self.source}) instead of setting {key}.source"),
            (self.template in TEMPLATES,
             f"{key}.template={self.template!r} is unknown; valid: {', '.join(TEMPLATES)}"),
        )
