"""Token-exact continuation: the token ids to send for a text that extends known texts.

A conversation's history is sent again with every turn, as text. Tokenizing it again
can give other ids than the ones the model produced (a word split differently), and then
the KV cache misses from that point on. Wherever the exact ids of an earlier text are
known (an answer this process generated, a conversation's tokens), the continuation
reuses them for the longest part of the new text they cover and tokenizes only the rest.

One function, :func:`continue_text`, serves every caller: chat completions and the
Responses API on the server (known texts from its memory of recent answers), and the
CLI's local conversation (the known text is the conversation so far). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

Encode = Callable[[str], list[int]]
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class KnownText:
    """A text whose exact token ids are known.

    ``prefix_ids`` are the ids of ``prefix_text`` (a rendered prompt, say); ``ids`` follow
    them (the answer) and decode, as a whole or any leading part, to text that follows
    ``prefix_text``. ``text`` is ``prefix_text`` + the decoded ``ids``. A prefix of the
    ``ids`` can be reused on its own (a client that kept only part of an answer); the
    ``prefix_ids`` only as a whole.
    """

    prefix_text: str
    prefix_ids: tuple[int, ...]
    ids: tuple[int, ...]
    text: str

    @property
    def num_tokens(self) -> int:
        return len(self.prefix_ids) + len(self.ids)


@dataclass(frozen=True)
class Continuation:
    """What to send for a text: ``token_ids`` = the first ``reused`` ids of ``source``, then
    ``rest_text`` tokenized on its own."""

    token_ids: list[int]
    reused: int
    source: KnownText | None
    rest_text: str


def continue_text(text: str, known: Iterable[KnownText], *, encode: Encode, decode: Decode) -> Continuation:
    """The token ids for ``text``, reusing the known text that covers the most of it.

    A known text that ``text`` starts with is reused whole. Otherwise, among known texts
    whose ``prefix_text`` ``text`` starts with, the longest leading run of ``ids`` whose
    decoding ``text`` continues is reused (found by bisection: ``decode`` runs
    O(log n) times). With nothing reusable the whole text is encoded.
    """
    best: tuple[int, int, KnownText] | None = None  # (characters covered, ids reused, source)
    for item in known:
        if not text.startswith(item.prefix_text):
            continue
        if text.startswith(item.text):
            covered, reused = len(item.text), item.num_tokens
        else:
            n = _longest_decoded_prefix(item.ids, text[len(item.prefix_text):], decode)
            covered = len(item.prefix_text) + len(decode(item.ids[:n])) if n else len(item.prefix_text)
            reused = len(item.prefix_ids) + n
        if reused and (best is None or (covered, reused) > best[:2]):
            best = (covered, reused, item)
    if best is None:
        return Continuation(encode(text) if text else [], 0, None, text)
    covered, reused, source = best
    rest = text[covered:]
    head = list(source.prefix_ids) + list(source.ids[:reused - len(source.prefix_ids)])
    return Continuation(head + (encode(rest) if rest else []), reused, source, rest)


def _longest_decoded_prefix(ids: Sequence[int], text: str, decode: Decode) -> int:
    """The largest n such that ``decode(ids[:n])`` is a prefix of ``text`` (bisection).

    Decoding is monotone in the usual case (more ids, longer text); a tokenizer that is
    not, at some boundary, only makes the answer shorter than it could be, never wrong:
    the returned n always satisfies the condition.
    """
    if text.startswith(decode(ids)):
        return len(ids)
    lo, hi = 0, len(ids)  # decode(ids[:lo]) is a prefix of text; decode(ids[:hi]) is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(decode(ids[:mid])):
            lo = mid
        else:
            hi = mid
    return lo
