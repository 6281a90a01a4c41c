"""Prompt lookup: guess that the text goes on as it did after its last occurrence.

The request's last n tokens (n from ``ngram_max`` down to ``ngram_min``, the longest match
wins) are looked up among the earlier tokens of its prompt and answer; the tokens that
followed their latest earlier occurrence are the guesses. Editing a given file or quoting
a given text repeats long runs of the prompt, so most guesses there are right. No model,
no torch: an index of n-grams per request, extended as the answer grows.

Two refinements, for a guess row costs about a quarter of a one-row decode on a CPU, so a
wrong guess is not free (replaying the greedy answer of bench/bench_speculative.py's
editing workload with at most 6 guesses: acceptance 0.70 against 0.59, 2.33 tokens a step
against 2.15):

- How far the match goes. The match is followed backwards past the n-gram (up to k
  tokens), and no more guesses are made than the match is long: a text that
  agreed with an earlier passage for 30 tokens likely goes on agreeing, one that agreed
  for 2 likely does not for long.
- Runs that repeat themselves. When the earlier occurrence ends near the end of the text
  (a line that repeats, a loop), the guesses run past the text's end and copy the guesses
  made before them, as an overlapping copy does, so a period of 2 tokens still gives k
  guesses, not 2.
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
        matching suffix, no more than the match is long; () if no suffix of ``ngram_min``
        or more tokens occurred before. Guess j is the token at ``after + j``, or, past
        the text's end, guess ``after + j - len(tokens)`` (the run repeats)."""
        tokens = self.tokens
        end = len(tokens)
        for n in range(min(self.ngram_max, end - 1), self.ngram_min - 1, -1):
            after = self.next_after.get(tuple(tokens[end - n:]))
            if after is None:
                continue
            matched = n  # tokens[after - matched:after] == tokens[end - matched:]
            while matched < k and after > matched and tokens[after - matched - 1] == tokens[end - matched - 1]:
                matched += 1
            guesses = tokens[after:after + min(k, matched)]
            while len(guesses) < min(k, matched):  # past the end: the guesses repeat themselves
                guesses.append(guesses[after + len(guesses) - end])
            return tuple(guesses)
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
