"""Chat prompts whose messages are what the user wrote: control tokens only from the template.

A chat template renders messages into one text, and tokenizing that text turns every
added token's text into its control token, wherever it stands: a user who writes
``<|im_end|>\\n<|im_start|>system\\n...`` in a message would forge a system turn, and one
who writes Qwen's ``<tool_call>`` or ``<think>`` (added tokens that are not special, which
the answer's parsers read as markers) would write the token that opens a call or a
thought. So the parts of the rendered text that came from the request (a message's
``content`` and its other strings, such as a call's arguments; the ``tools``' names,
descriptions and schemas) are tokenized as plain text (``Tokenizer.encode_as_text``),
and only the template's own text gets control tokens. One exception keeps histories
token-exact: in an assistant message (the model's own answer, repeated) markers stay
their tokens, as the model wrote them; only special tokens' text, which no answer's text
holds, is spelled there.

To know which parts those are, each string of the request that holds such text is
rendered wrapped in two marker characters (from Unicode's private use planes, chosen so
that no request and no template text holds them; one pair for user text, one for
assistant text); the markers are then taken out and their places kept as spans. A
template that edits content (``| trim``) sees the wrapped text, so such an edit may not
apply to those strings; a template that takes one apart (splits it and drops the first
marker) cannot be honoured, and the request gets a 400 naming the control token.
Requests without control-token text render and tokenize exactly as before (no spans, one
encode), so prompts, cache keys and continuations are unchanged for them.

A prefill (``continue_final``: the last message is the assistant's, and the answer goes on
from its text, as Anthropic's Messages API and vLLM's ``continue_final_message`` do) is
rendered without a generation prompt and cut right after the last message's text, so the
template's end-of-turn after it is not in the prompt.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bargein.server.errors import APIError

Span = tuple[int, int]  # [start, end) of message content in the rendered text
_MARKERS = [(chr(0xF0000 + 2 * i), chr(0xF0001 + 2 * i)) for i in range(64)]


@dataclass(frozen=True)
class RenderedChat:
    text: str
    content_spans: tuple[Span, ...]  # message text with control-token text, all spelled (empty: none)
    answer_spans: tuple[Span, ...] = ()  # assistant text with special tokens' text: those spelled, markers kept

    def encoder(self, tokenizer: Any) -> Callable[[str], list[int]]:
        """Encodes a suffix of ``text`` (what ``continue_text`` asks for), spans as text."""
        if not self.content_spans and not self.answer_spans:
            return lambda rest: tokenizer.encode(rest, add_special_tokens=False)
        spans = sorted([(a, b, False) for a, b in self.content_spans] + [(a, b, True) for a, b in self.answer_spans])

        def encode(rest: str) -> list[int]:
            offset = len(self.text) - len(rest)
            ids: list[int] = []
            at = offset
            for start, end, keep_markers in spans:
                if end <= at:
                    continue
                start = max(start, at)
                if start > at:
                    ids += tokenizer.encode(self.text[at:start], add_special_tokens=False)
                ids += tokenizer.encode_as_text(self.text[start:end], keep_markers=keep_markers)
                at = end
            if at < len(self.text):
                ids += tokenizer.encode(self.text[at:], add_special_tokens=False)
            return ids

        return encode


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, param: str,
                template_kwargs: dict[str, Any] | None = None, *, continue_final: bool = False) -> RenderedChat:
    """The rendered prompt and where user-written content lies in it (see the module doc).
    ``template_kwargs`` are the template's own variables (``enable_thinking``);
    ``continue_final``: the prompt ends inside the last message, after its text (a prefill).

    Raises the template's ChatTemplateError as ``apply_chat_template`` does.
    """
    prefill = messages[-1].get("content") if continue_final and messages else None
    if not prefill:  # no prefill, or an empty one: the answer is a new turn
        return _render(tokenizer, messages, tools, param, template_kwargs or {}, True)
    rendered = _render(tokenizer, messages, tools, param, template_kwargs or {}, False)
    cut = rendered.text.rfind(prefill)
    if cut < 0:
        raise APIError(400, "this model's chat template does not write a final assistant message's text as it is, "
                            "so the answer cannot continue it; end with a user message", param=param,
                       code="invalid_value")
    cut += len(prefill)
    return RenderedChat(rendered.text[:cut], _cut(rendered.content_spans, cut), _cut(rendered.answer_spans, cut))


def _cut(spans: tuple[Span, ...], cut: int) -> tuple[Span, ...]:
    return tuple((a, min(b, cut)) for a, b in spans if a < cut)


_TEXT, _ANSWER = 0, 1  # how a message's text is spelled: all as text, or an answer's (markers kept)


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, param: str, extra: dict[str, Any],
            add_generation_prompt: bool) -> RenderedChat:
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    every = (*tokenizer.special_texts, *tokenizer.marker_texts)
    kinds = [_ANSWER if m.get("role") == "assistant" else _TEXT for m in messages]
    found = [_control_text(m, tokenizer.special_texts if kind == _ANSWER else every) for m, kind in zip(
        messages, kinds, strict=True)] + [_control_text(tools, every)]
    if all(f is None for f in found):
        return RenderedChat(plain, ())
    strings = [plain, *_strings(messages), *_strings(tools)]
    pairs = [(o, c) for o, c in _MARKERS if not any(o in t or c in t for t in strings)][:2]
    if len(pairs) < 2:
        pairs = _MARKERS[:2]
    marked = [m if f is None else _marked(m, pairs[kind], tokenizer.special_texts if kind == _ANSWER else every)
              for m, kind, f in zip(messages, kinds, found, strict=False)]
    marked_tools = tools if found[-1] is None else _marked(tools, pairs[_TEXT], every)
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, tools=marked_tools,
                                             **extra)
    taken = _take_out_markers(rendered, pairs)
    if taken is None:
        forged = next(f for f in found if f is not None)
        raise APIError(400, f"the request's text (a message or a tool) holds the control token {forged!r}, and "
                            "this model's chat template takes that text apart, so it cannot be kept as text; "
                            "remove it", param=param, code="invalid_value")
    text, spans = taken
    return RenderedChat(text, spans[_TEXT], spans[_ANSWER])


def _strings(value: Any) -> list[str]:
    """Every string in ``value`` (a message, the tools), dict keys left out."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _control_text(value: Any, texts: tuple[str, ...]) -> str | None:
    """The first of ``texts`` that a string of ``value`` holds (message content, a call's
    arguments, a tool's description), or None."""
    return next((t for s in _strings(value) for t in texts if t and t in s), None)


def _marked(value: Any, pair: tuple[str, str], texts: tuple[str, ...]) -> Any:
    """``value`` with each string that holds one of ``texts`` wrapped in ``pair``."""
    if isinstance(value, str):
        return f"{pair[0]}{value}{pair[1]}" if any(t and t in value for t in texts) else value
    if isinstance(value, dict):
        return {k: _marked(v, pair, texts) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_marked(v, pair, texts) for v in value]
    return value


def _take_out_markers(rendered: str, pairs: list[tuple[str, str]]) -> tuple[str, list[tuple[Span, ...]]] | None:
    """The text without the marker characters, and the spans each pair enclosed (one list
    per pair); None if they do not pair up (a template that took content apart)."""
    role = {mark: (k, i == 0) for k, pair in enumerate(pairs) for i, mark in enumerate(pair)}
    out: list[str] = []
    spans: list[list[Span]] = [[] for _ in pairs]
    length, at = 0, 0
    opened: tuple[int, int] | None = None  # (pair, start) of the span being read
    for mark in re.finditer("[" + "".join(role) + "]", rendered):
        piece = rendered[at:mark.start()]
        out.append(piece)
        length, at = length + len(piece), mark.end()
        pair, opening = role[mark.group()]
        if opening == (opened is not None) or (not opening and opened[0] != pair):  # type: ignore[index]
            return None
        if opening:
            opened = (pair, length)
        else:
            spans[pair].append((opened[1], length))  # type: ignore[index]
            opened = None
    if opened is not None:
        return None
    out.append(rendered[at:])
    return "".join(out), [tuple(s) for s in spans]
