"""Trial answers through a freshly compiled grammar, before any request uses it.

llguidance compiles some grammars it cannot then run: a recursive ``$ref`` through
required properties, a pattern like ``(a{1000}){1000}``, a 5,000-way ``anyOf`` build
fine and fail at the first token with a parser or lexer limit (too many items, too many
regex states). Met in the engine thread, that failure would stall every other row's
step and end the answer in an error mid-way. So each compiled grammar first generates a
few short trial answers here (off the event loop and the engine thread, with a
deadline): each step computes the mask, picks an allowed token and consumes it. Any
error is a refusal with llguidance's own message; a walk that takes past the deadline is
refused as over the time budget. The walks are deterministic (a fixed seed), so a
grammar is refused or accepted the same way every time.

The lexer states a walk builds are shared with every later copy of the grammar, so the
first real request also starts warm.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # a signature's only: llguidance is imported where a grammar is built (grammar.py)
    import llguidance as llg

PROBE_STEPS = 40  # tokens per trial answer
PROBE_SEED = 20261201

# How a walk picks among the allowed tokens: at random, the shortest (one structural
# character at a time: deep recursion, long repetitions) and the longest (big leaps).
_PICKS: tuple[str, ...] = ("random", "shortest", "longest")


class ProbeFailed(ValueError):
    """A trial answer hit a grammar-engine error; the message says where and what."""


class ProbeOverBudget(ProbeFailed):
    """The trial answers took longer than their deadline."""


def probe(template: llg.LLMatcher, token_lengths: np.ndarray, deadline: float,
          clock: Callable[[], float] = time.monotonic) -> None:
    """Runs the trial answers on copies of ``template``; raises ProbeFailed on an error.

    ``token_lengths[i]``: token i's length in bytes (0 for tokens never allowed).
    ``deadline``: a ``clock()`` time after which the probe stops as ProbeOverBudget.
    """
    vocab = len(token_lengths)
    words = (vocab + 31) // 32
    rng = random.Random(PROBE_SEED)
    for pick in _PICKS:
        matcher = template.deep_copy()
        mask = np.zeros(words, dtype=np.int32)
        for step in range(PROBE_STEPS):
            if matcher.is_stopped():
                break
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
            if clock() > deadline:
                raise ProbeOverBudget(f"its trial answers were at token {step} of {PROBE_STEPS}")
            if matcher.is_error():
                raise ProbeFailed(_where(step, matcher.get_error()))
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
            if allowed.size == 0:
                raise ProbeFailed(_where(step, "no token is allowed and the grammar is not complete"))
            token = _pick(pick, allowed, token_lengths, rng)
            if not matcher.consume_token(token):
                raise ProbeFailed(_where(step, matcher.get_error()))


def _pick(how: str, allowed: np.ndarray, lengths: np.ndarray, rng: random.Random) -> int:
    if how == "random":
        return int(allowed[rng.randrange(allowed.size)])
    sizes = lengths[allowed]
    best = sizes.min() if how == "shortest" else sizes.max()
    candidates = allowed[sizes == best]
    return int(candidates[rng.randrange(candidates.size)])


def _where(step: int, message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return f"the grammar engine fails on it at token {step} of a trial answer: {first}"
