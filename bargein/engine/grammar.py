"""Grammar-constrained decoding: what a constrained request must match, compiled once,
and the per-request matchers whose token masks the sampler applies.

The grammar engine is llguidance (``llguidance`` on PyPI: a Rust core with no Python
dependencies). A :class:`Constraint` is plain data carried by ``SamplingParams``; the
engine's :class:`Grammars` compiles it once per constraint text (a bounded cache) and
hands each request a fresh :class:`GrammarMatcher` copied from the compiled one.

Contract (C3/C4 within a constraint): a matcher advances by exactly the tokens the
scheduler accepts for its request, never by a token a cancel dropped. It is derived from
delivered tokens: a continuation of a cancelled constrained answer builds its matcher by
replaying that answer's tokens (``Grammars.matcher(constraint, replay)``), so it is in
the same state as the uninterrupted run's at that point and the continuation picks the
same tokens.

Masks: :meth:`GrammarMasks.apply` fills the masks of all constrained rows of a step in
one call (llguidance computes them in parallel threads, without the GIL) and sets
disallowed logits to -inf before anything else in the sampler. End of sequence is
allowed only where the grammar accepts; once the grammar is complete, only end of
sequence is.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance as llg
import numpy as np
import torch

from bargein.engine.constraint import Constraint

# Compact JSON (no optional whitespace): a small model cannot loop on blank space, and
# a constrained answer has one spelling, which keeps re-rendered histories token-exact.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_CACHE_SIZE = 64


class UnsupportedGrammar(ValueError):
    """A constraint the grammar engine cannot enforce; the message names what (a 400)."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for ``constraint``; raises UnsupportedGrammar for malformed input."""
    if constraint.kind == "lark":
        return llg.LLMatcher.grammar_from_lark(constraint.text)
    try:
        schema = json.loads(constraint.text)
    except json.JSONDecodeError as exc:
        raise UnsupportedGrammar(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise UnsupportedGrammar("the JSON schema must be an object")
    return llg.LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))


def check_constraint(constraint: Constraint) -> None:
    """Raises UnsupportedGrammar naming what the grammar engine cannot enforce (e.g.
    ``Unimplemented keys: ["not"]``). Needs no tokenizer: cheap enough for any thread."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar_text(constraint))
    if is_error:
        raise UnsupportedGrammar(_first_line(messages[0]))


class GrammarMatcher:
    """One request's position in its grammar (engine thread only)."""

    def __init__(self, matcher: llg.LLMatcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size  # tokens the grammar knows; any later logit column is forbidden

    def accept(self, token_id: int) -> bool:
        """Advances by one accepted token; False if the grammar does not allow it."""
        return self._m.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and nothing but end of sequence may follow."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def error(self) -> str:
        return self._m.get_error()


class Grammars:
    """Compiles constraints for one tokenizer, once per constraint (thread-safe cache).

    The llguidance tokenizer (a trie of every token's bytes) is built on first use:
    about half a second for a 49k vocabulary, so callers compile in a worker pool.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: llg.LLTokenizer | None = None
        self._compiled: OrderedDict[Constraint, llg.LLMatcher] = OrderedDict()

    @property
    def grammar_vocab_size(self) -> int:
        return min(self._tokenizer.vocab_size, self.vocab_size)

    def compile(self, constraint: Constraint) -> None:
        """Compiles (or finds cached) ``constraint``; raises UnsupportedGrammar."""
        self._template(constraint)

    def matcher(self, constraint: Constraint, replay: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher, advanced by ``replay`` (the tokens of the answer so far);
        raises UnsupportedGrammar if the grammar does not accept them."""
        matcher = GrammarMatcher(self._template(constraint).deep_copy(), self.grammar_vocab_size)
        for i, token_id in enumerate(replay):
            if not matcher.accept(int(token_id)):
                raise UnsupportedGrammar(f"the answer so far does not match its grammar at token {i} "
                                         f"({token_id}): {_first_line(matcher.error)}")
        return matcher

    def _template(self, constraint: Constraint) -> llg.LLMatcher:
        with self._lock:
            found = self._compiled.get(constraint)
            if found is not None:
                self._compiled.move_to_end(constraint)
                return found
            tokenizer = self._ll_tokenizer = self._ll_tokenizer or self._build_tokenizer()
        grammar = grammar_text(constraint)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise UnsupportedGrammar(_first_line(messages[0]))
        compiled = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise UnsupportedGrammar(_first_line(compiled.get_error()))
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _build_tokenizer(self) -> llg.LLTokenizer:
        tok = self._tokenizer
        n = self.grammar_vocab_size
        return llg.LLTokenizer(llg.TokenizerWrapper(_TokenTable(tok, n, self._eos)), n_vocab=n,
                               eos_token=self._eos)


class _TokenTable:
    """What llguidance's TokenizerWrapper reads from a tokenizer: every token's bytes."""

    def __init__(self, tokenizer: Any, n: int, eos: list[int]):
        self._tokenizer = tokenizer
        self.eos_token_id = eos[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(t for t in getattr(tokenizer, "special_token_ids", ()) if t < n)
        self.tokens = [tokenizer.token_bytes(i, skip_special_tokens=False) for i in range(n)]

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarMasks:
    """Fills and applies the token masks of a step's constrained rows, all together:
    one bitmask for the batch, one masked fill of the logits."""

    def apply(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
        """``logits`` (B, V) with every token row i's grammar forbids set to -inf (a new
        tensor; rows without a matcher are unchanged). Columns past the grammar's
        vocabulary are forbidden in constrained rows."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        vocab = logits.shape[-1]
        grammar_vocab = min(rows[0][0].vocab_size, vocab)
        words = (rows[0][0].vocab_size + 31) // 32
        bitmask = np.zeros((len(rows), words), dtype=np.int32)
        base, row_bytes = bitmask.ctypes.data, words * 4
        # In this thread, one row after another (each some microseconds): llguidance's
        # parallel executor keeps worker threads spinning, which on a small CPU slows the
        # next forward far more than it saves here (measured: bench/bench_structured.py).
        for k, (matcher, _) in enumerate(rows):
            matcher._m.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)
        # Bits -> one bool per token (0/1 bytes viewed as bool, no copy), then one
        # torch.where: two passes over the constrained rows (measured 2x faster than
        # building a separate "forbidden" array for every row of the batch).
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)[:, :grammar_vocab]
        if grammar_vocab < vocab:  # columns past the grammar's vocab: forbidden
            allowed = torch.cat([allowed, allowed.new_zeros(len(rows), vocab - grammar_vocab)], dim=1)
        allowed = allowed.to(logits.device)
        forbidden = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
        if len(rows) == len(matchers):
            return torch.where(allowed, logits, forbidden)
        index = torch.tensor([i for _, i in rows], device=logits.device)
        out = logits.clone()
        out[index] = torch.where(allowed, logits[index], forbidden)
        return out


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "the grammar is not valid"
