"""Reasoning content: a thinking model's thoughts split from its answer's text.

A model whose chat template marks thinking (``loader.chat_template.thinking_markers``:
``<think>...</think>`` and the other pairs in use) writes its thoughts between the
markers, either after an opening marker the template already wrote into the generation
prompt (Qwen3, DeepSeek-R1) or one it writes itself at the start of its answer. With
``--reasoning-format separate`` (the default) every API returns them apart from the
answer: chat completions' ``reasoning_content`` (streamed as its own delta), Responses'
reasoning items, Messages' thinking blocks, Ollama's ``message.thinking``. With ``none``
the text stays as the model wrote it, markers included.

The split is a view of the text only: the engine's tokens, the prompt memory and the
cache are untouched, so a cancel mid-thought keeps exactly what was generated (C3), and
the answer's token ids are what the next turn continues from.

Rules (:class:`ReasoningSplitter`): an opening marker counts only before any answer text
(a model that mentions ``<think>`` in its answer is not thinking); white space around a
thought and right after its closing marker is dropped, as the templates write it back;
a marker split across deltas is held until it is whole, so the result does not depend on
how the text arrives.

Usage counts the thoughts' tokens (``reasoning_tokens`` in chat completions'
``completion_tokens_details`` and Responses' ``output_tokens_details``): the answer's
tokens up to the end of the thought's closing marker (all of them for an answer cut
mid-thought), found from the token ids themselves (:func:`reasoning_token_count`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from bargein.loader.chat_template import thinking_markers
from bargein.server.control_markers import guard_for, untagged
from bargein.server.tool_syntax import HERMES, call_parser
from bargein.server.tools import ArgumentsDelta, CallEnd, CallStart, ToolEvent, ToolSyntax


class ReasoningFormat(enum.StrEnum):
    NONE = "none"  # thoughts stay in the answer's text, markers included
    SEPARATE = "separate"  # thoughts are returned apart (reasoning_content, thinking blocks)


@dataclass(frozen=True)
class Thinking:
    """How one answer's thoughts are marked: the markers, and whether the prompt already
    opened a thought (the answer then starts inside it)."""

    open: str
    close: str
    starts_inside: bool


def thinking_for(template: str | None, prompt_text: str, fmt: ReasoningFormat, *,
                 constrained: bool = False, tokenizer: Any = None, prompt_ids: Sequence[int] = ()) -> Thinking | None:
    """The thinking of an answer to ``prompt_text`` (rendered by ``template``); None when
    thoughts are not split (format ``none``, a template that marks no thinking, or an
    answer ``constrained`` by a grammar from its first token: a JSON object or a forced
    call has no thoughts, even after a prompt that opened one).

    The answer starts inside a thought when the prompt's last opening marker comes after
    its last closing one. Given the ``tokenizer`` and the prompt's ids, markers that are
    one token of the vocabulary are found by their ids: message content is tokenized as
    text, so a user who writes ``<think>`` does not open a thought (``control_markers``)."""
    markers = thinking_markers(template)
    if fmt == ReasoningFormat.NONE or markers is None or constrained:
        return None
    open_, close = markers
    guard = guard_for(tokenizer, markers) if prompt_ids else None
    ids = {marker: token_id for token_id, marker in (*guard.markers.items(), *guard.inserted.items())
           } if guard is not None else {}
    if open_ in ids and close in ids:
        where = {token_id: i for i, token_id in enumerate(prompt_ids)}  # each id's last place
        inside = where.get(ids[open_], -1) > where.get(ids[close], -1)
    else:
        inside = prompt_text.rfind(open_) > prompt_text.rfind(close)
    return Thinking(open_, close, inside)


@dataclass(frozen=True)
class ReasoningDelta:
    """The next piece of the answer's thoughts."""

    text: str


AnswerEvent = ReasoningDelta | ToolEvent  # a str is answer text


class ReasoningSplitter:
    """Splits an answer's text, delta by delta, into thoughts and answer text, in order."""

    def __init__(self, thinking: Thinking):
        self.thinking = thinking
        self.inside = thinking.starts_inside
        self.thought_started = False  # some non-space text of the current thought went out
        self.answered = False  # some non-space answer text went out: no thought opens after it
        self._held = ""
        self._fed = 0  # characters of the answer fed so far
        self._closed_at = 0  # characters of the answer up to the last closing marker's end

    @property
    def thought_chars(self) -> int:
        """How many leading characters of the answer so far are thought (markers included):
        all of them while a thought is open."""
        return self._fed if self.inside else self._closed_at

    def feed(self, text: str, final: bool = False) -> list[str | ReasoningDelta]:
        buf, out = self._held + text, []
        start = self._fed - len(self._held)  # where ``buf`` begins in the answer, kept as buf is cut
        self._fed += len(text)
        while True:
            if self.inside:
                at = buf.find(self.thinking.close)
                if at < 0:
                    keep = 0 if final else _held_back(buf, self.thinking.close)
                    piece = buf[:len(buf) - keep]
                    self._thought(out, piece.rstrip() if final else piece)
                    buf = buf[len(buf) - keep:]
                    break
                self._thought(out, buf[:at].rstrip())
                cut = at + len(self.thinking.close)
                start, self._closed_at = start + cut, start + cut
                buf, self.inside, self.thought_started = buf[cut:], False, False
                continue
            if not self.answered:  # an opening marker may still come: only spaces so far
                stripped = buf.lstrip()
                if stripped.startswith(self.thinking.open):
                    start += len(buf) - len(stripped) + len(self.thinking.open)
                    buf, self.inside = stripped[len(self.thinking.open):], True
                    continue
                if not final and (not stripped or self.thinking.open.startswith(stripped)):
                    break  # all spaces, or the start of an opening marker: wait
                buf = stripped
                self.answered = bool(buf)
            out.append(buf)
            buf = ""
            break
        self._held = buf
        return [piece for piece in out if piece != ""]

    def _thought(self, out: list[str | ReasoningDelta], text: str) -> None:
        if not self.thought_started:
            text = text.lstrip()
        if text:
            self.thought_started = True
            out.append(ReasoningDelta(text))


class AnswerParser:
    """An answer's text, delta by delta, as thoughts, answer text and tool calls.

    Thoughts are split first (``thinking``: None keeps them in the text); the answer text
    then goes through the syntax's call parser (``tool_syntax.call_parser``) when tools
    are offered (``tool_names``). ``reasoning``, ``text`` and ``calls`` hold the whole
    answer so far.

    Given the ``tokenizer``, markers that are one token of its vocabulary count only where
    the model wrote them as that token (``control_markers``): feed each output's
    ``token_ids`` with its text. ``keeps_special``: the text holds special tokens' text
    (the request's ``skip_special_tokens`` is false).
    """

    def __init__(self, thinking: Thinking | None, tool_names: set[str] | None, syntax: ToolSyntax | None = None,
                 tokenizer: Any = None, keeps_special: bool = False):
        syntax = syntax or HERMES
        offered = tool_names is not None
        self.guard = guard_for(tokenizer, [*((thinking.open, thinking.close) if thinking is not None else ()),
                                           *((syntax.open, syntax.close) if offered else ())], keeps_special)
        if self.guard is not None:
            protect = self.guard.protect
            if thinking is not None:
                thinking = replace(thinking, open=protect(thinking.open), close=protect(thinking.close))
            syntax = replace(syntax, open=protect(syntax.open),
                             close=protect(syntax.close) if syntax.close is not None else None)
        self.keeps_special = keeps_special
        self.splitter = ReasoningSplitter(thinking) if thinking is not None else None
        self.tools = call_parser(tool_names, syntax) if tool_names is not None else None
        self.reasoning_parts: list[str] = []
        self.text_parts: list[str] = []

    def feed(self, text: str, final: bool = False, token_ids: Sequence[int] = ()) -> list[AnswerEvent]:
        if self.guard is not None:
            text = self.guard.tag(text, token_ids)
        pieces = self.splitter.feed(text, final) if self.splitter is not None else [text]
        events: list[AnswerEvent] = []
        answer = ""
        for piece in pieces:
            if isinstance(piece, ReasoningDelta):
                events += self._answer(answer, False)
                answer = ""
                piece = ReasoningDelta(untagged(piece.text))
                if piece.text:
                    self.reasoning_parts.append(piece.text)
                    events.append(piece)
            else:
                answer += piece
        events += self._answer(answer, final)
        return events

    def _answer(self, text: str, final: bool) -> list[AnswerEvent]:
        if self.tools is None:
            text = untagged(text)
            if text:
                self.text_parts.append(text)
            return [text] if text else []
        if not text and not final:
            return []
        content, events = self.tools.feed(text, final=final)
        self.text_parts.append(untagged(content))
        if self.guard is None:
            return list(events)
        for call in self.tools.calls:
            call.arguments = untagged(call.arguments)
        return [e for e in map(_untagged_event, events) if e != ""]

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def calls(self) -> list:
        return self.tools.calls if self.tools is not None else []

    @property
    def thought_chars(self) -> int:
        """Leading characters of the answer that are thought (``ReasoningSplitter.thought_chars``),
        in the text decoded with special tokens kept where ``counts_special_text``."""
        if self.splitter is None:
            return 0
        chars = self.splitter.thought_chars
        return self.guard.plain_chars(chars) if self.guard is not None else chars

    @property
    def counts_special_text(self) -> bool:
        """Whether ``thought_chars`` counts special tokens' text (a marker that is a special
        token, or a request that keeps them): count its tokens with them kept."""
        return self.keeps_special or (self.guard is not None and self.guard.counts_special_text)

    def thought_tokens(self, tokenizer: Any, token_ids: Sequence[int]) -> int:
        """How many of the answer's ``token_ids`` are thought (``reasoning_token_count``)."""
        return reasoning_token_count(tokenizer, token_ids, self.thought_chars,
                                     skip_special_tokens=not self.counts_special_text)


def _untagged_event(event: AnswerEvent) -> AnswerEvent:
    if isinstance(event, str):
        return untagged(event)
    if isinstance(event, ArgumentsDelta):
        return ArgumentsDelta(event.index, untagged(event.text))
    return event


def reasoning_token_count(tokenizer: Any, token_ids: Sequence[int], thought_chars: int, *,
                          skip_special_tokens: bool = True) -> int:
    """How many of an answer's ``token_ids`` write its first ``thought_chars`` characters:
    the fewest whose text reaches that far (a binary search over decoded prefixes, so a
    token that spans the thought's end counts as thought). Decoded as answers' text is by
    default (special tokens left out), or with them kept where the thought's markers are
    special tokens (``AnswerParser.counts_special_text``): markers the splitter saw are in
    that text."""
    if thought_chars <= 0:
        return 0
    ids = list(token_ids)
    low, high = 0, len(ids)
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=skip_special_tokens)) >= thought_chars:
            high = mid
        else:
            low = mid + 1
    return low


def parse_answer(text: str, thinking: Thinking | None, tool_names: set[str] | None,
                 syntax: ToolSyntax | None = None, tokenizer: Any = None, token_ids: Sequence[int] = (),
                 keeps_special: bool = False) -> AnswerParser:
    """A whole answer parsed at once (non-streamed bodies): the same result as its deltas
    (``token_ids``: the answer's, to tell control-token markers by; see AnswerParser)."""
    parser = AnswerParser(thinking, tool_names, syntax, tokenizer, keeps_special)
    parser.feed(text, final=True, token_ids=token_ids)
    return parser


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _held_back(text: str, close: str) -> int:
    """What a thought's text must hold back: a closing marker's start, and the spaces
    before it (dropped if the marker completes)."""
    partial = _partial_suffix(text, close)
    rest = text[:len(text) - partial]
    return partial + len(rest) - len(rest.rstrip())


__all__ = ["AnswerEvent", "AnswerParser", "CallEnd", "CallStart", "ReasoningDelta", "ReasoningFormat",
           "ReasoningSplitter", "Thinking", "parse_answer", "reasoning_token_count", "thinking_for"]
