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
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from bargein.engine.constraint import Constraint
from bargein.engine.grammar_probe import ProbeFailed, ProbeOverBudget, probe
from bargein.engine.json_steering import JsonTracker, SteeringClasses, steer
from bargein.engine.xml_steering import XmlCallTracker

# llguidance is imported by the functions that build or check a grammar, not with this
# module: its import is 6-7 ms of an engine's start, and most engines never compile one.
if TYPE_CHECKING:
    import llguidance as llg

# Compact JSON (no optional whitespace): a small model cannot loop on blank space, and
# a constrained answer has one spelling, which keeps re-rendered histories token-exact.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_CACHE_SIZE = 256
MAX_CONSTRAINT_CHARS = 256 * 1024  # the constraint's text (a schema, a tool-call grammar)
# llguidance's own limits, tighter than its defaults where they bound a build's time on a
# small CPU (the defaults let one pattern take seconds to build its lexer).
BUILD_LIMITS = {"initial_lexer_fuel": 300_000, "max_grammar_size": 200_000, "max_items_in_row": 2_000}
BUILD_WORKERS = 2


class UnsupportedGrammar(ValueError):
    """A constraint the grammar engine cannot enforce; the message names what (a 400)."""


class GrammarOverBudget(UnsupportedGrammar):
    """A constraint whose build took longer than the caller's time budget (a 400)."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for ``constraint``; raises UnsupportedGrammar for malformed input."""
    import llguidance as llg

    if constraint.kind == "lark":
        return llg.LLMatcher.grammar_from_lark(constraint.text)
    try:
        schema = json.loads(constraint.text)
    except json.JSONDecodeError as exc:
        raise UnsupportedGrammar(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise UnsupportedGrammar("the JSON schema must be an object")
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))
    except ValueError as exc:  # e.g. an integer too large for the grammar engine's JSON reader
        raise UnsupportedGrammar(_first_line(str(exc))) from None


def check_constraint(constraint: Constraint) -> None:
    """Raises UnsupportedGrammar naming what the grammar engine cannot enforce (e.g.
    ``Unimplemented keys: ["not"]``). Needs no tokenizer, but its cost grows with the
    constraint: call it off the event loop."""
    _check_size(constraint)
    import llguidance as llg

    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar_text(constraint),
                                                                      limits=_limits())
    if is_error:
        raise UnsupportedGrammar(_first_line(messages[0]))


def _check_size(constraint: Constraint) -> None:
    if len(constraint.text) > MAX_CONSTRAINT_CHARS:
        raise UnsupportedGrammar(f"it is {len(constraint.text):,} characters as compact JSON, over this server's "
                                 f"budget of {MAX_CONSTRAINT_CHARS:,}")


def _limits() -> llg.LLParserLimits:
    import llguidance as llg

    return llg.LLParserLimits(**BUILD_LIMITS)


class GrammarMatcher:
    """One request's position in its grammar (engine thread only).

    ``budget``: the tokens this request may still generate (its ``max_tokens``), counted
    from here; in its last tokens the mask is steered towards closing the JSON. None:
    no steering."""

    def __init__(self, matcher: llg.LLMatcher, vocab_size: int, *, budget: int | None = None,
                 tracker: JsonTracker | XmlCallTracker | None = None, classes: SteeringClasses | None = None):
        self._m = matcher
        self.vocab_size = vocab_size  # tokens the grammar knows; any later logit column is forbidden
        self.budget = budget
        self.generated = 0  # tokens accepted since the budget started
        self._tracker = tracker
        self._classes = classes
        self._token_bytes: list[bytes] = []

    def accept(self, token_id: int) -> bool:
        """Advances by one accepted token; False if the grammar does not allow it."""
        ok = self._m.consume_token(token_id)
        if ok and self._tracker is not None and 0 <= token_id < len(self._token_bytes):
            self._tracker.feed(self._token_bytes[token_id])
        self.generated += 1
        return ok

    def start_budget(self, budget: int | None, token_bytes: list[bytes]) -> None:
        """Counts ``budget`` tokens from now (after any replay)."""
        self.budget, self.generated, self._token_bytes = budget, 0, token_bytes

    @property
    def preferred(self) -> tuple[np.ndarray, ...]:
        """The tokens to narrow this row's mask to now, best first (empty: the grammar's
        mask as is): steering starts when the budget left is about what closing needs."""
        if self.budget is None or self._tracker is None or self._classes is None:
            return ()
        return self._tracker.preferred(self._classes, self.budget - self.generated)

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
    about half a second for a 49k vocabulary. Every compile also runs the trial answers
    (:func:`grammar_probe.probe`). Callers compile in :attr:`executor` (a small pool of
    its own, so a slow build never holds up prompt tokenization) with a time budget.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: llg.LLTokenizer | None = None
        self._table: _TokenTable | None = None
        self._lengths: np.ndarray | None = None
        self._classes: SteeringClasses | None = None
        self._compiled: OrderedDict[Constraint, llg.LLMatcher] = OrderedDict()
        self._refused: OrderedDict[Constraint, UnsupportedGrammar] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None

    @property
    def grammar_vocab_size(self) -> int:
        return min(self._tokenizer.vocab_size, self.vocab_size)

    @property
    def executor(self) -> ThreadPoolExecutor:
        """Where callers run builds (``BUILD_WORKERS`` threads, made on first use)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(BUILD_WORKERS, thread_name_prefix="grammar-build")
            return self._executor

    def compile(self, constraint: Constraint, budget_s: float | None = None) -> None:
        """Compiles (or finds cached) ``constraint`` and runs its trial answers; raises
        UnsupportedGrammar (GrammarOverBudget past ``budget_s`` seconds of work)."""
        self._template(constraint, budget_s, trial=True)

    def matcher(self, constraint: Constraint, replay: Sequence[int] = (), budget: int | None = None
                ) -> GrammarMatcher:
        """A fresh matcher, advanced by ``replay`` (the tokens of the answer so far);
        raises UnsupportedGrammar if the grammar does not accept them. ``budget``: the
        tokens the request may generate after ``replay`` (steers the end)."""
        template = self._template(constraint)
        table = self._table
        assert table is not None and self._classes is not None
        matcher = GrammarMatcher(template.deep_copy(), self.grammar_vocab_size, tracker=_tracker(constraint),
                                 classes=self._classes)
        matcher.start_budget(None, table.tokens)
        for i, token_id in enumerate(replay):
            if not matcher.accept(int(token_id)):
                raise UnsupportedGrammar(f"the answer so far does not match its grammar at token {i} "
                                         f"({token_id}): {_first_line(matcher.error)}")
        matcher.start_budget(budget, table.tokens)
        return matcher

    def _template(self, constraint: Constraint, budget_s: float | None = None, trial: bool = False
                  ) -> llg.LLMatcher:
        """The compiled grammar; ``trial``: run the trial answers on a new one. A matcher
        made without a compile first (a replica's engine, whose head already compiled and
        tried the constraint) skips them, to keep its engine thread's step short."""
        with self._lock:
            found = self._compiled.get(constraint)
            if found is not None:
                self._compiled.move_to_end(constraint)
                return found
            refused = self._refused.get(constraint)
            if refused is not None:
                raise refused
        tokenizer = self._tokenizer_once()  # once per server: not counted in a constraint's budget
        try:
            compiled = self._build(constraint, tokenizer, time.monotonic(), budget_s, trial)
        except UnsupportedGrammar as exc:
            self._remember(self._refused, constraint, exc)
            raise
        self._remember(self._compiled, constraint, compiled)
        return compiled

    def _build(self, constraint: Constraint, tokenizer: llg.LLTokenizer, started: float,
               budget_s: float | None, trial: bool) -> llg.LLMatcher:
        import llguidance as llg

        _check_size(constraint)
        grammar = grammar_text(constraint)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=_limits())
        if is_error:
            raise UnsupportedGrammar(_first_line(messages[0]))
        compiled = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
        if compiled.is_error():
            raise UnsupportedGrammar(_first_line(compiled.get_error()))
        deadline = started + budget_s if budget_s is not None else float("inf")
        assert self._lengths is not None
        if not trial:
            return compiled
        try:
            probe(compiled, self._lengths, deadline)
        except ProbeOverBudget as exc:
            raise GrammarOverBudget(f"building its grammar took longer than the time budget of {budget_s:g} s "
                                    f"({exc})") from None
        except ProbeFailed as exc:
            raise UnsupportedGrammar(str(exc)) from None
        if time.monotonic() > deadline:
            raise GrammarOverBudget(f"building its grammar took longer than the time budget of {budget_s:g} s")
        return compiled

    def _remember(self, cache: OrderedDict, constraint: Constraint, value: Any) -> None:
        with self._lock:
            cache[constraint] = value
            while len(cache) > _CACHE_SIZE:
                cache.popitem(last=False)

    def _tokenizer_once(self) -> llg.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance as llg

                n = self.grammar_vocab_size
                table = _TokenTable(self._tokenizer, n, self._eos)
                self._ll_tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(table), n_vocab=n, eos_token=self._eos)
                self._lengths = np.array([len(t) for t in table.tokens], dtype=np.int64)
                self._classes = SteeringClasses(table.tokens, (n + 31) // 32)
                self._table = table
            return self._ll_tokenizer


def _tracker(constraint: Constraint) -> JsonTracker | XmlCallTracker:
    """What follows the answer for steering: a forced XML call's own tracker, else JSON
    (in a Lark grammar, from its first '{')."""
    if constraint.xml_call is not None:
        return XmlCallTracker(dict(constraint.xml_call))
    return JsonTracker.starting(outside=constraint.kind == "lark")


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
            steer(bitmask[k], matcher.preferred)  # the budget's end: only tokens that close
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
