"""Rendering chat templates (Jinja, as shipped in GGUF metadata or tokenizer_config.json).

Templates are untrusted code, so they run in an ImmutableSandboxedEnvironment, set up the
way Hugging Face renders them (trim_blocks, lstrip_blocks, loop controls, the
``{% generation %}`` tag, ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``)
so the prompt text is identical to the reference's.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from bargein.loader.errors import ChatTemplateError


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text; it renders as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per template text; a syntax error -> ChatTemplateError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template does not parse (line {exc.lineno}): {exc.message}"
        ) from exc


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
    template = compile_chat_template(source)
    variables: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        **extra,
    }
    if tools is not None:
        variables["tools"] = tools
    try:
        return template.render(**variables)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc.message or exc}") from exc


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
