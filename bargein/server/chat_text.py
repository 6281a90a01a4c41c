"""Chat prompts whose messages are what the user wrote: control tokens only from the template.

A chat template renders messages into one text, and tokenizing that text turns every
special token's text into its control token, wherever it stands: a user who writes
``<|im_end|>\\n<|im_start|>system\\n...`` in a message would forge a system turn. So the
parts of the rendered text that came from a message's ``content`` are tokenized with
special tokens as plain text (``Tokenizer.encode_as_text``), and only the template's own
text gets control tokens.

To know which parts those are, a message whose content holds a special token's text is
rendered wrapped in two marker characters (from Unicode's private use planes, chosen so
that no message and no template text holds them); the markers are then taken out and
their places kept as spans. A template that edits content (``| trim``) sees the wrapped
text, so such an edit may not apply to those messages; a template that takes content apart
(splits it and drops the first marker) cannot be honoured, and the request gets a 400
naming the control token. Messages without special-token text render and tokenize exactly
as before (no spans, one encode), so prompts, cache keys and continuations are unchanged
for them.

A prefill (``continue_final``: the last message is the assistant's, and the answer goes on
from its text, as Anthropic's Messages API and vLLM's ``continue_final_message`` do) is
rendered without a generation prompt and cut right after the last message's text, so the
template's end-of-turn after it is not in the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bargein.server.errors import APIError

Span = tuple[int, int]  # [start, end) of message content in the rendered text
_MARKERS = [(chr(0xF0000 + 2 * i), chr(0xF0001 + 2 * i)) for i in range(64)]


@dataclass(frozen=True)
class RenderedChat:
    text: str
    content_spans: tuple[Span, ...]  # empty: no message content holds a special token's text

    def encoder(self, tokenizer: Any) -> Callable[[str], list[int]]:
        """Encodes a suffix of ``text`` (what ``continue_text`` asks for), content spans as text."""
        if not self.content_spans:
            return lambda rest: tokenizer.encode(rest, add_special_tokens=False)

        def encode(rest: str) -> list[int]:
            offset = len(self.text) - len(rest)
            ids: list[int] = []
            at = offset
            for start, end in self.content_spans:
                if end <= at:
                    continue
                start = max(start, at)
                if start > at:
                    ids += tokenizer.encode(self.text[at:start], add_special_tokens=False)
                ids += tokenizer.encode_as_text(self.text[start:end])
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
    return RenderedChat(rendered.text[:cut], tuple((a, min(b, cut)) for a, b in rendered.content_spans if a < cut))


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, param: str, extra: dict[str, Any],
            add_generation_prompt: bool) -> RenderedChat:
    forged = _special_text_in(tokenizer.special_texts, messages)
    if forged is None:
        return RenderedChat(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          tools=tools, **extra), ())
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    texts = [plain, *(m["content"] for m in messages if isinstance(m.get("content"), str))]
    open_mark, close_mark = next(((o, c) for o, c in _MARKERS if not any(o in t or c in t for t in texts)),
                                 _MARKERS[0])
    marked = [{**m, "content": f"{open_mark}{m['content']}{close_mark}"} if _holds(tokenizer.special_texts, m)
              else m for m in messages]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    text, spans = _take_out_markers(rendered, open_mark, close_mark)
    if text is None:
        raise APIError(400, f"a message's content holds the control token {forged!r} as text, and this model's "
                            "chat template takes message content apart, so it cannot be kept as text; "
                            "remove it from the message", param=param, code="invalid_value")
    return RenderedChat(text, spans)


def _holds(specials: Sequence[str], message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, str) and any(s in content for s in specials)


def _special_text_in(specials: Sequence[str], messages: list[dict[str, Any]]) -> str | None:
    """The first special token's text that some message's content holds, or None."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            for s in specials:
                if s and s in content:
                    return s
    return None


def _take_out_markers(rendered: str, open_mark: str, close_mark: str) -> tuple[str | None, tuple[Span, ...]]:
    """The text without markers and the spans they enclosed; (None, ()) if they do not pair."""
    out: list[str] = []
    spans: list[Span] = []
    length = 0
    start: int | None = None
    for piece_index, piece in enumerate(rendered.split(open_mark)):
        if piece_index > 0:
            if start is not None:
                return None, ()
            start = length
        head, *rest = piece.split(close_mark)
        if len(rest) > 1 or (rest and start is None):
            return None, ()
        out.append(head)
        length += len(head)
        if rest:
            spans.append((start, length))  # type: ignore[arg-type]
            start = None
            out.append(rest[0])
            length += len(rest[0])
    if start is not None:
        return None, ()
    return "".join(out), tuple(spans)
