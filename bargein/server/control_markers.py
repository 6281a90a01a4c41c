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

Two kinds of marker tokens:

- *added* tokens that decoding keeps (Qwen's ``<tool_call>``, ``<think>``): their text is
  in the answer's text, and the guard tags the occurrence the token wrote;
- *special* tokens (Mistral's ``[TOOL_CALLS]``, ``[THINK]``), which decoding leaves out
  of the text (unless the request keeps special tokens, ``skip_special_tokens: false``,
  when they are tagged as above): the guard inserts the marker's tagged text where the
  token stands, so the parsers see it there and nowhere else.

Grammars that write markers (a forced call, ``tools.ToolPlan.constraint``; the thinking
budget) write them as their tokens (:func:`marker_token_id`), so what they force parses
the same way.

How: :class:`MarkerGuard` sees each output's new token ids beside its text, finds where
in the text each marker token stands (the length of the text the tokens before it make,
from their bytes as the detokenizer builds the text), and puts :data:`TAG` in front of
the marker's text there (inserting the text too, :data:`INSERTED` ... :data:`TAG`, for a
special token left out). The parsers are given the tagged spelling of protected markers
(:meth:`MarkerGuard.protect`), so text without the tag is never a marker, and they take
every tag (and every inserted text that was not used as a marker) out of what they return
(:func:`untagged`). Tags are lone surrogates: text decoded from tokens never holds one, so
no output can forge a tagged marker.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

TAG = "\udbff"  # never in decoded text (decoding makes valid Unicode): marks a marker written as its token
INSERTED = "\udbfe"  # opens the text of a special token the decoded text left out; TAG closes it
_INSERTED_TEXT = re.compile(INSERTED + "[^" + TAG + "]*" + TAG)
_SLACK = 2  # characters a marker may sit off its computed place (decoders' leading-space rules)


def untagged(text: str) -> str:
    """``text`` without tags, and without the text of special tokens that were inserted."""
    if INSERTED in text:
        text = _INSERTED_TEXT.sub("", text)
    return text.replace(TAG, "") if TAG in text else text


class MarkerGuard:
    """Tags the markers an answer's tokens wrote as control tokens, output by output.

    One guard per answer (it keeps the answer's token bytes). ``tag`` takes each output's
    ``delta_text`` and ``new_token_ids`` in order; ``tag_offsets`` are where tag
    characters went in the tagged text (so positions in it can be mapped back to the
    answer's text, inserted markers' text included: :meth:`plain_chars`).

    ``markers``: control token id -> its text, for markers whose text the answer's text
    holds; ``inserted``: the same for special tokens the answer's text leaves out.
    """

    def __init__(self, tokenizer: Any, markers: dict[int, str], inserted: dict[int, str] | None = None,
                 keeps_special: bool = False):
        self.tokenizer = tokenizer
        self.markers = markers
        self.inserted = inserted or {}
        self.keeps_special = keeps_special  # the answer's text holds special tokens' text
        self.tag_offsets: list[int] = []  # where tag characters are in the tagged text
        self._bytes = bytearray()  # the answer's bytes so far, as the detokenizer reads its tokens
        self._plain = 0  # characters of the answer's text tagged so far
        self._tagged = 0  # characters of tagged text given out so far
        self._pending: list[tuple[int, str, bool]] = []  # (place in the answer's text, marker, inserted)

    def protect(self, marker: str) -> str:
        """The spelling of ``marker`` the parsers look for: tagged when it is a control token."""
        if marker in self.inserted.values():
            return INSERTED + marker + TAG
        return TAG + marker if marker in self.markers.values() else marker

    def tag(self, text: str, new_token_ids: Sequence[int]) -> str:
        for token_id in new_token_ids:
            marker, inserted = self.markers.get(token_id), self.inserted.get(token_id)
            if marker is not None or inserted is not None:
                place = len(self._bytes.decode("utf-8", errors="replace"))
                self._pending.append((place, inserted or marker, inserted is not None))  # type: ignore[arg-type]
            self._bytes += self.tokenizer.token_bytes(token_id, skip_special_tokens=not self.keeps_special)
        out, at, waiting = [], 0, []
        for place, marker, inserted in self._pending:
            local = place - self._plain
            if inserted:
                if local > len(text):
                    waiting.append((place, marker, inserted))  # the text before it has not arrived yet
                    continue
                found = max(at, local)
                added = INSERTED + marker + TAG
                start = self._tagged + sum(map(len, out)) + len(text[at:found])
                self.tag_offsets += [start, start + 1 + len(marker)]
            else:
                found = text.find(marker, max(at, local - _SLACK))
                if not 0 <= found <= local + _SLACK:
                    if local + len(marker) > len(text):
                        waiting.append((place, marker, inserted))  # its text has not arrived yet
                    continue
                added = TAG
                self.tag_offsets.append(self._tagged + sum(map(len, out)) + len(text[at:found]))
            out.append(text[at:found])
            out.append(added)
            at = found
        out.append(text[at:])
        self._pending = waiting
        self._plain += len(text)
        tagged = "".join(out)
        self._tagged += len(tagged)
        return tagged

    @property
    def counts_special_text(self) -> bool:
        """Whether :meth:`plain_chars` counts special tokens' text (inserted or kept): then
        it is a position in the text decoded with special tokens kept."""
        return self.keeps_special or bool(self.inserted)

    def plain_chars(self, tagged_chars: int) -> int:
        """The answer's characters that ``tagged_chars`` characters of tagged text stand for
        (an inserted marker's text counted, ``counts_special_text``)."""
        return tagged_chars - sum(1 for offset in self.tag_offsets if offset < tagged_chars)


def marker_token_id(tokenizer: Any, text: str | None) -> int | None:
    """The id of a marker's ``text`` where it is one token of ``tokenizer``'s vocabulary,
    else None. A grammar that writes the marker writes that token (``<[id]>``): a literal
    would also let the model spell it in other tokens (which the parsers rightly read as
    text), and a special token's spelling never makes the token at all."""
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None and text else []
    return ids[0] if len(ids) == 1 else None


def guard_for(tokenizer: Any, markers: Iterable[str | None], keeps_special: bool = False) -> MarkerGuard | None:
    """The guard of the ``markers`` that are one token of ``tokenizer``'s vocabulary, or
    None when none is (then the text is read as it is). ``keeps_special``: the answer's
    text holds special tokens' text (``skip_special_tokens: false``)."""
    if tokenizer is None:
        return None
    found: dict[int, str] = {}
    inserted: dict[int, str] = {}
    for marker in markers:
        if marker:
            ids = tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) == 1:
                left_out = ids[0] in tokenizer.special_token_ids and not keeps_special
                (inserted if left_out else found)[ids[0]] = marker
    return MarkerGuard(tokenizer, found, inserted, keeps_special) if found or inserted else None
