"""Prompt data: seeded problem sources and prompt templates."""

from nemo_sspo.data.tasks import PROMPT_SOURCES, Problem, PromptSource, build_prompt_source
from nemo_sspo.data.templates import TEMPLATES, render_prompt

__all__ = ["PROMPT_SOURCES", "TEMPLATES", "Problem", "PromptSource", "build_prompt_source", "render_prompt"]
