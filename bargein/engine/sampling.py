"""SamplingParams: how one request picks its tokens, validated at construction.

A ``SamplingParams`` that exists is valid, except for what depends on the model: token
ids (in ``logit_bias`` and ``stop_token_ids``) are checked against the vocabulary by
``validate_for_vocab``, which the engine calls when it accepts the request. Every error is
an ``InvalidSamplingParams`` (a ``ValueError``) whose ``field`` names the offending field,
so the server can answer 400 and point at the parameter.

Values are normalised once, here: ``stop`` given as one string becomes a 1-tuple,
``logit_bias`` given as a mapping becomes a tuple of ``(token_id, bias)`` pairs sorted by
token id, sequences become tuples, ints given for float fields become floats. The result
is hashable and compares by value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from bargein.engine.constraint import Constraint

MAX_LOGPROBS = 20  # top alternatives one token may carry (the OpenAI limit)
MAX_TEMPERATURE = 2.0  # the OpenAI range; higher is noise, not creativity
MAX_ABS_BIAS = 100.0
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties, as in OpenAI
# torch.Generator.manual_seed accepts exactly this range.
_MAX_KEY_DIGITS = 19  # no vocabulary is larger; longer keys are refused before int() parses them
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


class InvalidSamplingParams(ValueError):
    """A sampling parameter a user gave is out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings.

    Sampling order (see ``sampler.py``): min_tokens masking of eos/stop ids ->
    ``logit_bias`` -> ``repetition_penalty`` -> presence/frequency penalties ->
    greedy argmax when ``temperature == 0``, else temperature -> ``top_k`` -> ``top_p``
    -> ``min_p`` -> sample.

    - ``max_tokens``: tokens to generate at most; None: until the context is full.
    - ``min_tokens``: eos and ``stop_token_ids`` are masked until this many were generated.
    - ``temperature``: 0 is greedy; in [0, 2].
    - ``top_p`` in (0, 1]; ``top_k`` >= 1 or None (off); ``min_p`` in [0, 1] (0 is off).
    - ``repetition_penalty`` > 0 (1 is off), over prompt and output tokens.
    - ``presence_penalty``, ``frequency_penalty`` in [-2, 2], over output tokens.
    - ``logit_bias``: ``(token_id, bias)`` pairs, bias in [-100, 100], added to the logits;
      a ``Mapping`` is accepted and normalised.
    - ``stop``: strings that end the output (the detokenizer matches them); one str is
      accepted. ``stop_token_ids``: token ids that end the output.
    - ``ignore_eos``: eos does not end the output (the engine's concern, not the sampler's).
    - ``logprobs``: None is off; 0..20 is how many top alternatives to return besides the
      sampled token's own log-probability.
    - ``seed``: makes the request's tokens reproducible whatever it is batched with. With
      ``n > 1`` the engine must derive one seed per choice, or the choices are identical.
    - ``skip_special_tokens``: leave special tokens out of the text.
    - ``n``: number of choices to generate for the prompt.
    - ``constraint``: a grammar the output must match (JSON Schema, or Lark for tool
      calls); tokens it forbids are never sampled, and end of sequence only where it is
      complete. Not with ``min_tokens`` or ``ignore_eos`` (they would fight the grammar's end).
    - ``cache_salt``: the prefix-cache namespace (vLLM's name): the request reuses only K/V
      computed by requests with the same salt, and its own K/V is reused only by them.
      None is the common namespace. Not a sampling setting, but carried with them so that
      every path to the engine (local, pipeline, replicas) takes it unchanged.
    - ``speculative``: False opts this request out of the engine's speculative decoding
      (``--speculative``). Not a sampling setting either: the tokens are the same both
      ways; only the work per token differs.
    """

    max_tokens: int | None = 256
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    seed: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    constraint: Constraint | None = None
    cache_salt: str | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.max_tokens is not None:
            put("max_tokens", _int("max_tokens", self.max_tokens, lo=1, none_ok=True))
        put("min_tokens", _int("min_tokens", self.min_tokens, lo=0))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams(
                "min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        put("temperature", _float("temperature", self.temperature, 0.0, MAX_TEMPERATURE))
        put("top_p", _float("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        if self.top_k is not None:
            put("top_k", _int("top_k", self.top_k, lo=1, none_ok=True))
        put("min_p", _float("min_p", self.min_p, 0.0, 1.0))
        put(
            "repetition_penalty",
            _float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True),
        )
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _float(name, getattr(self, name), -MAX_ABS_PENALTY, MAX_ABS_PENALTY))
        put("logit_bias", _logit_bias(self.logit_bias))
        put("stop", _stop(self.stop))
        put("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        for name in ("ignore_eos", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(
                    name, f"{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.logprobs is not None:
            put("logprobs", _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS, none_ok=True))
        if self.seed is not None:
            put("seed", _int("seed", self.seed, lo=MIN_SEED, hi=MAX_SEED, none_ok=True))
        put("n", _int("n", self.n, lo=1))
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidSamplingParams("cache_salt", f"cache_salt must be a string, got {self.cache_salt!r}")
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise InvalidSamplingParams("constraint", f"constraint must be a Constraint, got {self.constraint!r}")
            for name in ("min_tokens", "ignore_eos"):
                if getattr(self, name):
                    raise InvalidSamplingParams(name, f"{name} cannot be combined with a grammar constraint "
                                                      "(structured output ends where its grammar is complete)")

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is always taken (``temperature == 0``)."""
        return self.temperature == 0.0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ``InvalidSamplingParams`` if a token id is not below ``vocab_size``."""
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise InvalidSamplingParams(
                    "logit_bias",
                    f"logit_bias token id {token_id} is out of the vocabulary [0, {vocab_size})",
                )
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise InvalidSamplingParams(
                    "stop_token_ids",
                    f"stop_token_ids token id {token_id} is out of the vocabulary "
                    f"[0, {vocab_size})",
                )


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int(name: str, value: object, lo: int, hi: int | None = None, none_ok: bool = False) -> int:
    """``value`` as an int in [lo, hi], or an error that names the field and the range."""
    upper = "" if hi is None else f" and <= {hi}"
    if not _is_int(value) or value < lo or (hi is not None and value > hi):  # type: ignore[operator]
        or_none = " or None" if none_ok else ""
        raise InvalidSamplingParams(
            name, f"{name} must be an integer >= {lo}{upper}{or_none}, got {value!r}"
        )
    return int(value)  # type: ignore[call-overload]


def _float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> float:
    """``value`` as a finite float in [lo, hi] (or (lo, hi]), else a clear error."""
    bracket = "(" if lo_open else "["
    upper = "inf)" if math.isinf(hi) else f"{hi:g}]"
    if _is_real(value):
        number = float(value)  # type: ignore[arg-type]
        above_lo = number > lo if lo_open else number >= lo
        if math.isfinite(number) and above_lo and number <= hi:
            return number
    raise InvalidSamplingParams(
        name, f"{name} must be a finite number in {bracket}{lo:g}, {upper}, got {value!r}"
    )


def _token_ids(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidSamplingParams(name, f"{name} must be a sequence of token ids, got {value!r}")
    ids = tuple(value)
    for token_id in ids:
        if not _is_int(token_id) or token_id < 0:
            raise InvalidSamplingParams(
                name, f"{name} must hold integer token ids >= 0, got {token_id!r}"
            )
    return tuple(int(token_id) for token_id in ids)


def _stop(value: object) -> tuple[str, ...]:
    """One string or a sequence of non-empty strings, as a tuple."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise InvalidSamplingParams("stop", f"stop must be a string or strings, got {value!r}")
    stops = tuple(value)
    for stop in stops:
        if not isinstance(stop, str) or not stop:
            raise InvalidSamplingParams("stop", f"stop must hold non-empty strings, got {stop!r}")
    return stops


def _short(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters so an error message stays small."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 128 else f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A mapping or pairs of token id -> bias, as pairs sorted by token id.

    Decimal string keys are accepted because that is how JSON (and so the OpenAI API)
    writes them.
    """
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        pairs = list(value)
    else:
        raise InvalidSamplingParams(
            "logit_bias", f"logit_bias must map token ids to biases, got {value!r}"
        )
    biases: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise InvalidSamplingParams(
                "logit_bias", f"logit_bias must hold (token_id, bias) pairs, got {pair!r}"
            )
        key, bias = pair
        if isinstance(key, str) and key.isdecimal() and len(key) <= _MAX_KEY_DIGITS:
            key = int(key)
        if not _is_int(key) or key < 0:
            raise InvalidSamplingParams(
                "logit_bias", f"logit_bias keys must be token ids >= 0, got {_short(key)}"
            )
        if int(key) in biases:
            raise InvalidSamplingParams(
                "logit_bias", f"logit_bias gives token id {key} more than once"
            )
        biases[int(key)] = _float("logit_bias", bias, -MAX_ABS_BIAS, MAX_ABS_BIAS)
    return tuple(sorted(biases.items()))
