"""Prompt lookup: guess that the text goes on as it did after its last occurrence.

The request's last n tokens (n from ``ngram_max`` down to ``ngram_min``, the longest match
wins) are looked up among the earlier tokens of its prompt and answer; the tokens that
followed their latest earlier occurrence are the guesses. Editing a given file or quoting
a given text repeats long runs of the prompt, so most guesses there are right. No model,
no torch: an index of n-grams per request, extended as the answer grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from bargein.engine.speculative.proposer import DraftRequest


@dataclass
class _NgramIndex:
    """For each n-gram of the indexed tokens, the position of the token after its latest
    occurrence (only n-grams followed by a token are indexed)."""

    ngram_min: int
    ngram_max: int
    tokens: list[int] = field(default_factory=list)  # the tokens indexed so far
    next_after: dict[tuple[int, ...], int] = field(default_factory=dict)

    def update(self, token_ids: Sequence[int]) -> None:
        """Indexes ``token_ids``; starts over if they do not extend what was indexed."""
        n_old = len(self.tokens)
        if list(token_ids[:n_old]) != self.tokens:  # a cut tail (a cancel): a copy at C speed
            self.tokens, self.next_after, n_old = [], {}, 0
        self.tokens.extend(token_ids[n_old:])
        tokens = self.tokens
        for i in range(max(n_old, 1), len(tokens)):
            for n in range(self.ngram_min, min(self.ngram_max, i) + 1):
                self.next_after[tuple(tokens[i - n:i])] = i

    def lookup(self, k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix; () if no suffix of ``ngram_min`` or more tokens occurred before."""
        tokens = self.tokens
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            after = self.next_after.get(tuple(tokens[len(tokens) - n:]))
            if after is not None:
                return tuple(tokens[after:after + k])
        return ()


class NgramProposer:
    """A :class:`~bargein.engine.speculative.proposer.Proposer` by prompt lookup."""

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        drafts = {}
        for r in requests:
            index = self._indexes.get(r.request_id)
            if index is None:
                index = self._indexes[r.request_id] = _NgramIndex(self.ngram_min, self.ngram_max)
            index.update(r.token_ids)
            guess = index.lookup(r.k)
            if guess:
                drafts[r.request_id] = guess
        return drafts

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
