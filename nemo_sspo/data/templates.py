"""Prompt templates: turn a question into the exact text the rollout engine tokenises."""

from __future__ import annotations

__all__ = ["QWEN_MATH_TEMPLATE", "TEMPLATES", "prompt_messages", "render_prompt"]

QWEN_MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# Qwen2.5-Math's chain-of-thought prompt (its evaluation harness calls it "qwen25-math-cot"; the
# Dr. GRPO / SimpleRL-style RL recipes on Qwen2.5-Math train with it): ChatML with the instruction as
# the system message. Written out literally, so a base model's tokenizer needs no chat template.
QWEN_MATH_TEMPLATE = (
    "<|im_start|>system\n" + QWEN_MATH_INSTRUCTION + "<|im_end|>\n"
    "<|im_start|>user\n{question}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
CHAT_BOXED_SYSTEM = "You are a careful math tutor."
CHAT_BOXED_INSTRUCTION = "Solve it step by step, one step per line. Put the final answer in \\boxed{}."
# One worked example turn: a 135M instruct model almost never writes \boxed{} from the instruction
# alone (measured: 6% of responses), so the template shows the format once. The example uses the
# same kind of story as the default task (addition and subtraction), since the model imitates it.
CHAT_BOXED_EXAMPLE = (
    "Ann has 4 pens. She buys 3 more pens. Then she gives 2 pens to a friend. How many pens does Ann have now?",
    "Ann starts with 4 pens.\nShe buys 3 more: 4 + 3 = 7 pens.\nShe gives 2 away: 7 - 2 = 5 pens.\n\\boxed{5}",
)
TEMPLATES = ("qwen-math", "chat-boxed", "chat-cot")
"""Valid ``template`` names for :func:`render_prompt`."""


def render_prompt(tokenizer, question: str, template: str) -> str:
    r"""The rendered prompt for ``question``; the rollout engine adds no special tokens to it.

    Templates:
        ``"qwen-math"``: the paper's Qwen-Math prompt (:data:`QWEN_MATH_TEMPLATE`):
        ``"<|im_start|>system\nPlease reason step by step, and put your final answer within
        \boxed{}.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"``.
        The ChatML markers are special tokens of the Qwen2.5 (and SmolLM2) tokenizers; the text
        is the same for base and instruct models and ``tokenizer`` is unused.
        ``"chat-boxed"``: ``tokenizer.apply_chat_template`` over a short tutor system message,
        one worked example (user question + assistant answer, :data:`CHAT_BOXED_EXAMPLE`), then
        the user message ``"{question}\n" + CHAT_BOXED_INSTRUCTION`` (one step per line, final
        answer in ``\boxed{}``), with the assistant turn opened.
        ``"chat-cot"``: ``tokenizer.apply_chat_template`` over one user message
        ``"{question}\n" + QWEN_MATH_INSTRUCTION``, no system message, assistant turn opened
        (the math prompt the DeepSeek-R1-Distill and Qwen3 model cards recommend; their own
        templates then open the reasoning block, e.g. R1-Distill's ``<think>\n``).

    Raises:
        ValueError: unknown ``template``, or ``"chat-boxed"`` with a tokenizer lacking a chat template.
    """
    messages = prompt_messages(question, template)
    if template == "qwen-math":
        return QWEN_MATH_TEMPLATE.replace("{question}", question, 1)  # not .format: \boxed{} has braces
    return _chat(tokenizer, template, messages)


def prompt_messages(question: str, template: str) -> list[dict[str, str]]:
    """The chat messages of ``template``'s prompt for ``question`` (``{"role", "content"}`` dicts).

    ``"chat-boxed"`` and ``"chat-cot"``: the messages :func:`render_prompt` passes to the
    tokenizer's chat template. ``"qwen-math"``: a system message holding
    :data:`QWEN_MATH_INSTRUCTION` and a user message holding ``question``; a ChatML chat template
    (Qwen2.5, Qwen3) with the assistant turn opened renders them to exactly
    :data:`QWEN_MATH_TEMPLATE`'s text. Hosts that take messages rather than text (verl's RL
    dataset) get the same prompts from these.

    Raises:
        ValueError: unknown ``template``.
    """
    if template == "qwen-math":
        return [{"role": "system", "content": QWEN_MATH_INSTRUCTION}, {"role": "user", "content": question}]
    if template == "chat-boxed":
        example_question, example_answer = CHAT_BOXED_EXAMPLE
        return [{"role": "system", "content": CHAT_BOXED_SYSTEM},
                {"role": "user", "content": f"{example_question}\n{CHAT_BOXED_INSTRUCTION}"},
                {"role": "assistant", "content": example_answer},
                {"role": "user", "content": f"{question}\n{CHAT_BOXED_INSTRUCTION}"}]
    if template == "chat-cot":
        return [{"role": "user", "content": f"{question}\n{QWEN_MATH_INSTRUCTION}"}]
    raise ValueError(f"template={template!r} is unknown; valid templates: {', '.join(TEMPLATES)}")


def _chat(tokenizer, template: str, messages: list[dict[str, str]]) -> str:
    """``messages`` through the tokenizer's chat template, assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"template={template!r} needs a tokenizer with a chat template; use 'qwen-math'")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
