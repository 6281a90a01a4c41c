"""Incremental detokenizing: token ids in, releasable text out, UTF-8-safe, with stop strings.

A character split over several byte tokens is held until complete (an incremental
UTF-8 decoder over the tokens' raw bytes), so a stream never shows a broken character.
Text that could still turn into a stop string is held back; once a stop string appears,
the text is cut before it and nothing after it is ever released.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class TokenBytes(Protocol):
    """What the detokenizer needs from a tokenizer (bargein.loader.Tokenizer has it)."""

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = True) -> bytes: ...


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text, one token at a time.

    Contract:
      - ``push(token_id)`` returns only text that is final: complete characters that can
        no longer become part of a stop string. Concatenating every return value of
        ``push`` and ``flush`` gives ``text``.
      - ``flush()`` is called when generation ends; it releases what was held back (an
        incomplete trailing character becomes U+FFFD, as ``tokenizer.decode`` does).
      - When a stop string appears, ``stop_matched`` is set to it, ``text`` ends right
        before it, and later ``push``/``flush`` calls return "".
      - Without stop strings, ``text`` after ``flush`` equals ``tokenizer.decode(ids)``
        for byte-level vocabularies.
    """

    def __init__(
        self, tokenizer: TokenBytes, *, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet released: a possible start of a stop string
        self._released: list[str] = []
        self.stop_matched: str | None = None

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._released)

    @property
    def finished(self) -> bool:
        """True once a stop string matched; nothing more will be released."""
        return self.stop_matched is not None

    def push(self, token_id: int) -> str:
        """Add one token; return the text it makes releasable (often "")."""
        if self.finished:
            return ""
        data = self._tokenizer.token_bytes(token_id, skip_special_tokens=self._skip_special_tokens)
        return self._advance(self._utf8.decode(data), final=False)

    def flush(self) -> str:
        """End of generation: release everything still held (after a last stop check)."""
        if self.finished:
            return ""
        return self._advance(self._utf8.decode(b"", final=True), final=True)

    def _advance(self, new_text: str, *, final: bool) -> str:
        self._held += new_text
        cut = self._find_stop()
        if cut is not None:
            index, stop = cut
            out, self._held, self.stop_matched = self._held[:index], "", stop
        else:
            keep = 0 if final else self._stop_prefix_length()
            out, self._held = (
                self._held[: len(self._held) - keep],
                self._held[len(self._held) - keep :],
            )
        if out:
            self._released.append(out)
        return out

    def _find_stop(self) -> tuple[int, str] | None:
        """The earliest stop string in the held text (first listed wins a tie).

        Released text never ends with a stop string's prefix, so a match always starts
        inside the held text.
        """
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._held.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _stop_prefix_length(self) -> int:
        """Length of the longest suffix of the held text that begins some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:n]):
                    longest = n
                    break
        return longest
