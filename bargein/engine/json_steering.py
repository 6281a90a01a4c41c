"""Steering a JSON answer to close before its token budget runs out.

A grammar says which tokens may come next, not how soon the answer ends: an open
object (``json_object``, a schema with free-form parts) may grow until ``max_tokens``
cuts it, and the client gets JSON that does not parse. So, in the last tokens of the
budget, a constrained row's mask is narrowed further to the tokens that head for the
end: close the open string, end the number, close the open containers, pick a short
value where one is expected. The narrowing is only ever an intersection with the
grammar's own mask, and when the intersection is empty (the grammar needs a required
key, more items, more characters) the grammar's mask is used unchanged, so steering
never makes an answer invalid or leaves it without a token.

:class:`JsonTracker` follows the answer's bytes (the tokens the matcher accepted) with
a small JSON state machine: where we are (a value expected, inside a string, after a
value, a key expected) and how deep. :class:`SteeringClasses` holds, per state, the
tokens that make progress towards the end, as bitmasks over the vocabulary, built once
per tokenizer. Token ``i`` is bit ``i % 32`` of word ``i // 32`` (llguidance's layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

# Steering starts when the tokens left are at most (what closing needs) + this margin.
# The margin covers a grammar's fixed tail after the JSON (a tool call's closing tag is
# five or six tokens; seven with a byte tokenizer) and a forced key or two.
STEER_MARGIN = 10


class JsonState(Enum):
    OUTSIDE = "outside"  # before the JSON starts (a tool call's opening tag)
    VALUE = "value"  # a value is expected (after ':' or ',' in an array, or '[')
    STRING = "string"  # inside a string value
    KEY_STRING = "key_string"  # inside an object key
    COLON = "colon"  # after a key, before ':'
    KEY = "key"  # after '{' or ',' in an object: a key (or '}' after '{')
    AFTER_VALUE = "after_value"  # inside a number or literal, or after a value
    DONE = "done"  # the top-level value is complete


@dataclass
class JsonTracker:
    """The JSON state of an answer's text so far, fed byte by byte (compact JSON)."""

    state: JsonState = JsonState.VALUE
    stack: list[str] = field(default_factory=list)  # the open containers, '{' or '['
    escaped: bool = False

    @classmethod
    def starting(cls, outside: bool) -> JsonTracker:
        """``outside``: the JSON starts at the first '{' (a tool call's ``<tool_call>`` first)."""
        return cls(JsonState.OUTSIDE if outside else JsonState.VALUE)

    def feed(self, data: bytes) -> None:
        for byte in data:
            self._char(chr(byte))

    @property
    def tokens_to_close(self) -> int:
        """About how many tokens closing takes from here, end of sequence included: one
        per open container, one to end a string, two for a value still to come (``""``
        may be two tokens), and the colon and value after a key."""
        if self.state == JsonState.DONE:
            return 1
        if self.state == JsonState.OUTSIDE:
            return 3
        pending = {JsonState.STRING: 1, JsonState.KEY_STRING: 4, JsonState.COLON: 3, JsonState.KEY: 1,
                   JsonState.VALUE: 2}.get(self.state, 0)
        return len(self.stack) + pending + 1

    def preferred(self, classes: SteeringClasses, tokens_left: int) -> tuple[np.ndarray, ...]:
        """The tokens to narrow the mask to with ``tokens_left`` of the budget, best first
        (empty: the grammar's mask as is): steering starts when the budget left is about
        what closing needs."""
        if self.state in (JsonState.DONE, JsonState.OUTSIDE):
            return ()
        if tokens_left > self.tokens_to_close + STEER_MARGIN:
            return ()
        return classes.for_state(self.state, in_array=bool(self.stack) and self.stack[-1] == "[")

    def _char(self, c: str) -> None:
        state = self.state
        if state in (JsonState.STRING, JsonState.KEY_STRING):
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.state = JsonState.COLON if state == JsonState.KEY_STRING else JsonState.AFTER_VALUE
        elif state == JsonState.OUTSIDE:
            if c in "{[":
                self._open(c)
        elif state == JsonState.VALUE:
            if c == '"':
                self.state = JsonState.STRING
            elif c in "{[":
                self._open(c)
            elif c == "]":
                self._close()
            elif not c.isspace():
                self.state = JsonState.AFTER_VALUE  # a number or a literal began
        elif state == JsonState.KEY:
            if c == '"':
                self.state = JsonState.KEY_STRING
            elif c == "}":
                self._close()
        elif state == JsonState.COLON:
            if c == ":":
                self.state = JsonState.VALUE
        elif state == JsonState.AFTER_VALUE:
            if c == ",":
                self.state = JsonState.KEY if self.stack and self.stack[-1] == "{" else JsonState.VALUE
            elif c in "}]":
                self._close()

    def _open(self, c: str) -> None:
        self.stack.append(c)
        self.state = JsonState.KEY if c == "{" else JsonState.VALUE

    def _close(self) -> None:
        if self.stack:
            self.stack.pop()
        self.state = JsonState.AFTER_VALUE if self.stack else JsonState.DONE


_LONGEST = 32  # the longest token token_count looks for, in bytes
_SHORT_VALUES = {b'""', b"{}", b"[]", b"true", b"false", b"null", b'"', *(str(d).encode() for d in range(10))}


class SteeringClasses:
    """Per JSON state, the tokens that move an answer towards its end (bitmasks)."""

    def __init__(self, token_bytes: Sequence[bytes], words: int):
        self._token_bytes, self._words = token_bytes, words
        self._ids: dict[bytes, list[int]] | None = None  # token ids by their bytes (made on first use)
        self._prefixes: dict[bytes, np.ndarray] = {}
        def mask(pred) -> np.ndarray:
            bits = np.zeros(words * 32, dtype=np.uint8)
            for i, data in enumerate(token_bytes):
                if data and pred(data):
                    bits[i] = 1
            return np.packbits(bits, bitorder="little").view(np.int32)

        closers = mask(lambda b: set(b) <= set(b"}]"))
        close_string = mask(lambda b: b[:1] == b'"' and set(b) <= set(b'"}]'))
        values = mask(lambda b: b in _SHORT_VALUES)
        self._by_state: dict[JsonState, tuple[np.ndarray, ...]] = {
            JsonState.VALUE: (values,), JsonState.STRING: (close_string,), JsonState.KEY_STRING: (close_string,),
            JsonState.AFTER_VALUE: (closers,), JsonState.KEY: (closers,)}
        self._array_value = (closers, values)  # ']' ends an array at once; else a short item

    def _ids_by_bytes(self) -> dict[bytes, list[int]]:
        if self._ids is None:
            ids: dict[bytes, list[int]] = {}
            for i, data in enumerate(self._token_bytes):
                if data:
                    ids.setdefault(data, []).append(i)
            self._ids = ids
        return self._ids

    def text_prefixes(self, text: bytes) -> np.ndarray:
        """The tokens that spell a start of ``text`` (a bitmask; cached per text: the
        closing texts of a tool call's syntax are few)."""
        found = self._prefixes.get(text)
        if found is None:
            ids = self._ids_by_bytes()
            bits = np.zeros(self._words * 32, dtype=np.uint8)
            for k in range(1, len(text) + 1):
                bits[ids.get(text[:k], [])] = 1
            found = self._prefixes[text] = np.packbits(bits, bitorder="little").view(np.int32)
        return found

    def token_count(self, text: bytes) -> int:
        """About how many tokens ``text`` takes: the longest token at each step."""
        ids, count, at = self._ids_by_bytes(), 0, 0
        while at < len(text):
            at = next((end for end in range(min(len(text), at + _LONGEST), at, -1) if text[at:end] in ids), at + 1)
            count += 1
        return count

    def for_state(self, state: JsonState, in_array: bool = False) -> tuple[np.ndarray, ...]:
        """The tokens to prefer in ``state``, best first (empty: no preference)."""
        if state == JsonState.VALUE and in_array:
            return self._array_value
        return self._by_state.get(state, ())


def steer(row: np.ndarray, preferred: Sequence[np.ndarray]) -> None:
    """Narrows the grammar's mask ``row`` (int32 words, in place) to the first of
    ``preferred`` that leaves a token; if none does, the grammar's mask stands."""
    for tokens in preferred:
        narrowed = row & tokens
        if narrowed.any():
            row[:] = narrowed
            return
