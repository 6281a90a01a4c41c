"""Rendering chat templates (Jinja, as shipped in GGUF metadata or tokenizer_config.json).

Templates are untrusted code: they run in the sandbox of jinja_sandbox.py, set up the way
Hugging Face renders them, so the prompt text is identical to the reference's.
"""

from __future__ import annotations

from typing import Any

from bargein.loader.errors import ChatTemplateError


def render_chat_template(
    source: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[Any] | None = None,
    **extra: Any,
) -> str:
    """The prompt text for ``messages``. ``extra`` carries bos_token, eos_token and any
    template-specific variables. There is no fallback format: a model without a template
    raises ChatTemplateError, since guessing a format would silently degrade answers."""
    if source is None:
        raise ChatTemplateError(
            "this model has no chat template (none in the GGUF metadata or tokenizer_config.json); "
            "use plain completions instead"
        )
    variables: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        **extra,
    }
    if tools is not None:
        variables["tools"] = tools
    # Jinja is imported on the first render, not with the loader (see jinja_sandbox.py).
    from bargein.loader.jinja_sandbox import render

    return render(source, variables)


# -- thinking -------------------------------------------------------------------------------
# Reasoning models mark their thoughts in the answer's text with a pair of markers their
# template knows. The pairs in use, the common one first: a template that writes one of
# them (to open a thought in the generation prompt, or to strip earlier ones) marks thinking.
THINKING_MARKERS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("<seed:think>", "</seed:think>"))
THINKING_SWITCH = "enable_thinking"  # the template variable Qwen3-style templates read


def thinking_markers(source: str | None) -> tuple[str, str] | None:
    """The (open, close) markers of thoughts that ``source`` (a chat template) uses, or None
    when the template does not mark thinking."""
    if not source:
        return None
    for pair in THINKING_MARKERS:
        if pair[1] in source:
            return pair
    return None


def has_thinking_switch(source: str | None) -> bool:
    """Whether the template reads ``enable_thinking`` (thinking can be switched off)."""
    return bool(source) and THINKING_SWITCH in source
