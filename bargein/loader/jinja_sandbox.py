"""The Jinja sandbox chat templates run in, set up the way Hugging Face renders them.

Templates are untrusted code, so they run in an ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks, loop controls, the ``{% generation %}`` tag,
``raise_exception``, ``strftime_now`` and a non-escaping ``tojson``, so the prompt text is
identical to the reference's. Imported by chat_template.py on the first render, not at
start-up: importing jinja2 is ~5% of the bundled model's load (callgrind), which loading a
model and its first token never need.
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


def render(source: str, variables: dict[str, Any]) -> str:
    """``source`` compiled (once) and rendered with ``variables``; a syntax error or an
    error while rendering -> ChatTemplateError."""
    template = compile_chat_template(source)
    try:
        return template.render(**variables)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc.message or exc}") from exc
