"""Encoding text with a ``tokenizers`` backend: the one call, its error, and plain text.

``encode_one`` goes through ``encode_batch``, which gives the same ids as ``encode`` but
releases the GIL while it works (``encode`` holds it: 7 s for a 4 MB text, during which no
other thread, the engine's included, runs a line of Python). Text that is not valid
Unicode (a lone surrogate from a JSON ``"\\ud800"`` escape) raises
``UnencodableTextError`` (a ``ValueError``) instead of the backend's ``TypeError``;
checked only when the backend refuses, so valid text pays nothing.

``PlainTextEncoder`` encodes with special tokens' text treated as text: what a user wrote
in a chat message, where ``<|im_end|>`` must stay the characters the user typed and never
become the control token that ends a turn (issue 34).
"""

from __future__ import annotations

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
    """Encodes text with special tokens' text as plain text; thread-safe.

    The backend's ``encode_special_tokens`` flag is its own state, so it is set on a copy
    (made on first use: a copy of a 49k vocabulary takes a fraction of a second), never on
    the shared backend that renders prompts for other requests.
    """

    def __init__(self, backend: HFTokenizer):
        self._backend = backend
        self._plain: HFTokenizer | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, HFTokenizer]:
        """Pickled (a tokenizer shipped to a Ray node) without its lock and lazy copy."""
        return {"backend": self._backend}

    def __setstate__(self, state: dict[str, HFTokenizer]) -> None:
        self.__init__(state["backend"])

    def encode(self, text: str) -> list[int]:
        with self._lock:
            if self._plain is None:
                plain = HFTokenizer.from_str(self._backend.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
        return encode_one(self._plain, text, add_special_tokens=False)
