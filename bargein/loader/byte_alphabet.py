"""The byte alphabets of BPE vocabularies: GPT-2's byte-level characters and SentencePiece's
byte-fallback pieces (``<0x0A>``), for building tokenizers and reading tokens' bytes."""

from __future__ import annotations

import re


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}
# A character outside that alphabet; a regex search is ~4x faster than set(piece) <= alphabet,
# which counts at start-up over a 49k vocabulary.
_OUTSIDE_BYTE_ALPHABET = re.compile("[^" + re.escape("".join(sorted(BYTE_OF_CHAR))) + "]")


def in_byte_alphabet(text: str) -> bool:
    """Whether every character of ``text`` is one of GPT-2's byte alphabet."""
    return _OUTSIDE_BYTE_ALPHABET.search(text) is None


def is_byte_piece(piece: str) -> bool:
    """A SentencePiece byte-fallback piece, ``<0x0A>``: one byte of text."""
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
