"""Admission: the checks a request passes before any engine sees it, in one place.

``admit`` is called once, at the engine client's edge (``AsyncEngine``/``Engine.add_request``
in this process, the replica set's head across Ray): it encodes a text prompt, checks the
sampling parameters against the vocabulary, compiles the constraint (a bad grammar is
refused here), checks the vocabulary range of token ids, the context length, the timeout
and the continuation offsets, and returns an :class:`Admitted` request. Each rule has one
error message. The scheduler trusts what it gets; what only the engine thread can know (a
conversation's length) it checks with :func:`check_length`, the same rule and message.

One tokenization of a text prompt: a prompt of its own is encoded with the tokenizer's
special tokens (a BOS where the model has one); a conversation's turn is text inside the
conversation, encoded without them, on one machine and on replicas alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bargein.engine.grammar import Grammars
from bargein.engine.sampling import SamplingParams


class EngineError(Exception):
    """A request the engine refuses (bad prompt, id in use); the message says why."""


class TooLong(EngineError, ValueError):
    """A prompt or conversation that cannot fit the context."""


@dataclass(frozen=True)
class Admitted:
    """A request that passed every check: what the engine may trust."""

    token_ids: tuple[int, ...]  # the prompt (a conversation's turn: its new tokens)
    params: SamplingParams
    timeout: float | None  # seconds, > 0
    conversation_id: str | None = None
    constraint_from: int | None = None
    output_offset: int = 0


def encode_prompt(tokenizer: Any, prompt: str, *, in_conversation: bool) -> list[int]:
    """The one tokenization of a text prompt (see the module doc)."""
    return tokenizer.encode(prompt, add_special_tokens=not in_conversation)


def check_length(num_tokens: int, max_model_len: int, what: str = "the prompt") -> None:
    """Raises TooLong unless ``num_tokens`` leaves room for one generated token."""
    if num_tokens >= max_model_len:
        raise TooLong(f"{what} is {num_tokens} tokens, but the context holds {max_model_len} "
                      f"(room is needed for at least one generated token)")


def admit(prompt: str | Sequence[int], params: SamplingParams | None, *, tokenizer: Any, grammars: Grammars,
          vocab_size: int, max_model_len: int, timeout: float | None = None, conversation_id: str | None = None,
          constraint_from: int | None = None, output_offset: int = 0) -> Admitted:
    """Checks a request; returns it admitted, or raises EngineError (UnsupportedGrammar for
    a constraint that cannot be enforced, InvalidSamplingParams for parameters)."""
    params = params or SamplingParams()
    params.validate_for_vocab(vocab_size)
    if params.constraint is not None:
        grammars.compile(params.constraint)  # cached per constraint
    if constraint_from is not None and (params.constraint is None or constraint_from < 0):
        raise EngineError("constraint_from needs a constraint and a token index >= 0")
    in_conversation = conversation_id is not None
    tokens = encode_prompt(tokenizer, prompt, in_conversation=in_conversation) if isinstance(prompt, str) \
        else [int(t) for t in prompt]
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if not in_conversation:
        if not tokens:
            raise EngineError("the prompt is empty")
        check_length(len(tokens), max_model_len)
    if timeout is not None and not timeout > 0:
        raise EngineError("timeout must be a positive number of seconds")
    if output_offset < 0 or (not in_conversation and output_offset > len(tokens)):
        raise EngineError(f"output_offset must be within the prompt (0..{len(tokens)})")
    return Admitted(tuple(tokens), params, timeout, conversation_id, constraint_from, output_offset)
