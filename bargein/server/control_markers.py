"""Markers the answer's parsers act on only where the model wrote them as control tokens.

A thinking model closes its thought with ``</think>`` and a Hermes or Qwen model opens a
call with ``<tool_call>``; where the vocabulary has one token for such a marker, the model
writes it as that token. The same characters can also come out as plain text: a model
that quotes a user who typed ``</think>``, or writes about tool calls. Read as markers,
they would end a thought early or turn quoted text into a call. So for every marker that
is one token of the vocabulary, the parsers act only on an occurrence the model wrote as
that token (by its id), never on the same characters spelled by other tokens. Markers the
vocabulary spells with several tokens (the byte-level test tokenizers, SmolLM2's
``<tool_call>``) are read in the text as before: there is nothing else to tell them by.
Nor are markers that are *special* tokens (left out of the text when decoding): what the
parsers see of those was written as text (a forced call's grammar writes its markers as
text), so guarding them would hide every call.

How: :class:`MarkerGuard` sees each output's new token ids beside its text, finds where
in the text each control token of a marker begins (the decoded length of the tokens
before it), and puts :data:`TAG` in front of it there. The parsers are given the tagged
spelling of protected markers (:meth:`MarkerGuard.protect`), so text without the tag is
never a marker, and they take every tag out of what they return (:func:`untagged`). The
tag is a lone surrogate: text decoded from tokens never holds one, so no output can forge
a tagged marker.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

TAG = "\udbff"  # never in decoded text (decoding makes valid Unicode): marks a marker written as its token
_SLACK = 2  # characters a marker may sit off its computed place (decoders' leading-space rules)


def untagged(text: str) -> str:
    return text.replace(TAG, "") if TAG in text else text


class MarkerGuard:
    """Tags the markers an answer's tokens wrote as control tokens, output by output.

    One guard per answer (it keeps the answer's token ids). ``tag`` takes each output's
    ``delta_text`` and ``new_token_ids`` in order; ``tag_offsets`` are where tags went in
    the tagged text (so positions in it can be mapped back to the answer's own text).
    """

    def __init__(self, tokenizer: Any, markers: dict[int, str]):
        self.tokenizer = tokenizer
        self.markers = markers  # control token id -> its text
        self.tag_offsets: list[int] = []
        self._ids: list[int] = []
        self._plain = 0  # characters of the answer's text tagged so far
        self._tagged = 0  # characters of tagged text given out so far
        self._pending: list[tuple[int, str]] = []  # (place in the answer's text, marker) not yet reached

    def protect(self, marker: str) -> str:
        """The spelling of ``marker`` the parsers look for: tagged when it is a control token."""
        return TAG + marker if marker in self.markers.values() else marker

    def tag(self, text: str, new_token_ids: Sequence[int]) -> str:
        for token_id in new_token_ids:
            marker = self.markers.get(token_id)
            if marker is not None:
                self._pending.append((len(self.tokenizer.decode(self._ids)), marker))
            self._ids.append(token_id)
        out, at, waiting = [], 0, []
        for place, marker in self._pending:
            local = place - self._plain
            found = text.find(marker, max(at, local - _SLACK))
            if 0 <= found <= local + _SLACK:
                out.append(text[at:found])
                self.tag_offsets.append(self._tagged + sum(map(len, out)))
                out.append(TAG)
                at = found
            elif local + len(marker) > len(text):
                waiting.append((place, marker))  # its text has not arrived yet
        out.append(text[at:])
        self._pending = waiting
        self._plain += len(text)
        tagged = "".join(out)
        self._tagged += len(tagged)
        return tagged

    def plain_chars(self, tagged_chars: int) -> int:
        """The answer's characters that ``tagged_chars`` characters of tagged text stand for."""
        return tagged_chars - sum(1 for offset in self.tag_offsets if offset < tagged_chars)


def guard_for(tokenizer: Any, markers: Iterable[str | None]) -> MarkerGuard | None:
    """The guard of the ``markers`` that are one token of ``tokenizer``'s vocabulary (and
    not a special token, which decoding leaves out), or None when none is (then the text
    is read as it is)."""
    if tokenizer is None:
        return None
    found: dict[int, str] = {}
    for marker in markers:
        if marker:
            ids = tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) == 1 and ids[0] not in tokenizer.special_token_ids:
                found[ids[0]] = marker
    return MarkerGuard(tokenizer, found) if found else None
