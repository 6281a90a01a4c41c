"""Encoding text with a ``tokenizers`` backend: the one call, its error, and plain text.

``encode_one`` goes through ``encode_batch``, which gives the same ids as ``encode`` but
releases the GIL while it works (``encode`` holds it: 7 s for a 4 MB text, during which no
other thread, the engine's included, runs a line of Python). Text that is not valid
Unicode (a lone surrogate from a JSON ``"\\ud800"`` escape) raises
``UnencodableTextError`` (a ``ValueError``) instead of the backend's ``TypeError``;
checked only when the backend refuses, so valid text pays nothing.

``PlainTextEncoder`` encodes with added tokens' text treated as text: what a user wrote
in a chat message, where ``<|im_end|>`` must stay the characters the user typed and never
become the control token that ends a turn (issue 34), nor ``<tool_call>`` or ``<think>``
(Qwen's added tokens that are not special, but that the answer's parsers read as markers)
the token that opens a call or a thought.
"""

from __future__ import annotations

import json
import threading

from tokenizers import Tokenizer as HFTokenizer


class UnencodableTextError(ValueError):
    """Text that UTF-8 cannot encode (a lone surrogate); ``position`` is its first bad index."""

    def __init__(self, position: int) -> None:
        super().__init__(f"the text holds a lone UTF-16 surrogate at character {position}, "
                         "which is not valid Unicode")
        self.position = position


def first_unencodable(text: str) -> int | None:
    """The index of the first character UTF-8 cannot encode, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def encode_one(backend: HFTokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    """The ids of one text (see the module doc)."""
    try:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    except TypeError:
        position = first_unencodable(text)
        if position is None:
            raise
        raise UnencodableTextError(position) from None


class PlainTextEncoder:
    """Encodes text with added tokens' text as plain text; thread-safe.

    The backend's ``encode_special_tokens`` flag is its own state, so it is set on a copy
    (made on first use: a copy of a 49k vocabulary takes a fraction of a second), never on
    the shared backend that renders prompts for other requests. The flag spells out only
    special tokens, so the copy that spells every added token marks them all special
    first (an added token's ``special`` changes nothing else in encoding). Two copies:
    ``keep_markers`` keeps the non-special added tokens (markers) as their ids.
    """

    def __init__(self, backend: HFTokenizer):
        self._backend = backend
        self._copies: dict[bool, HFTokenizer] = {}  # keep_markers -> its copy
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, HFTokenizer]:
        """Pickled (a tokenizer shipped to a Ray node) without its lock and lazy copy."""
        return {"backend": self._backend}

    def __setstate__(self, state: dict[str, HFTokenizer]) -> None:
        self.__init__(state["backend"])

    def encode(self, text: str, *, keep_markers: bool = False) -> list[int]:
        with self._lock:
            plain = self._copies.get(keep_markers)
            if plain is None:
                plain = self._copies[keep_markers] = _spelling_copy(self._backend, keep_markers)
        return encode_one(plain, text, add_special_tokens=False)


def _spelling_copy(backend: HFTokenizer, keep_markers: bool) -> HFTokenizer:
    """A copy of ``backend`` that spells out special tokens' text (and, unless
    ``keep_markers``, every added token's)."""
    state = json.loads(backend.to_str())
    if not keep_markers:
        for added in state.get("added_tokens") or ():
            added["special"] = True
    copy = HFTokenizer.from_str(json.dumps(state))
    copy.encode_special_tokens = True
    return copy
