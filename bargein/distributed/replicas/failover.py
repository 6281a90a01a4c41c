"""What becomes of a request whose replica was lost: one pure decision, tested without Ray.

:func:`decide` reads the head's record of the request and returns either
:class:`Resubmit` (its tokens, from the prompt plus the output received, with
``output_offset`` set so the sampler keeps counting token indices where it was: greedy
and seeded answers continue identically; ``max_tokens``/``min_tokens`` reduced by what was
produced; the rest of the deadline) or :class:`End` (cancelled, done, expired, or its
conversation closed). Where the resubmission goes is the router's choice; with no replica
up it ends with an error after all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bargein.distributed.replicas.records import LiveRequest
from bargein.engine.outputs import RequestDelta
from bargein.engine.request import CancelReason, FinishReason, Usage
from bargein.engine.sampling import SamplingParams
from bargein.engine.stats import RequestInfo


@dataclass(frozen=True)
class Resubmit:
    """Dispatch the request again: ``tokens`` as its prompt (a conversation's answer: the
    conversation up to the answer plus the answer so far)."""

    tokens: list[int]
    params: SamplingParams  # max_tokens and min_tokens less what was produced
    timeout: float | None  # the rest of the deadline
    output_offset: int  # tokens already produced
    constraint_from: int | None  # where the constrained answer began: its matcher replays from there
    reserve_tokens: int  # tokens still to generate at most (for the router's room check)


@dataclass(frozen=True)
class End:
    """End the request with this final delta's reason."""

    finish_reason: FinishReason
    cancel_reason: CancelReason | None = None
    error: str | None = None
    dropped_late: bool = False  # a cancel won the race with the failover


def decide(rec: LiveRequest, conversation_tokens: list[int] | None, *, cancel: CancelReason | None = None,
           stopped: bool = False, tombstoned: bool, why: str, now: float) -> Resubmit | End:
    """The fate of ``rec`` after its replica was lost (``why``).

    ``conversation_tokens``: the head's copy of the conversation ``rec`` extends (None: it
    was closed, or the request has none); its outcome claim (``RecordStore.ids``):
    ``cancel``, the reason of a cancel that claimed it, or ``stopped``, its consumer found
    its end (a stop string); ``tombstoned``: a cancel of its id was sent."""
    params, produced = rec.params, len(rec.output)
    if cancel is not None or tombstoned:
        return End(FinishReason.CANCELLED, cancel or CancelReason.USER, dropped_late=True)
    if stopped or (params.max_tokens is not None and produced >= params.max_tokens):
        return End(FinishReason.STOP if stopped else FinishReason.LENGTH)
    if rec.deadline is not None and rec.deadline <= now:
        return End(FinishReason.CANCELLED, CancelReason.DEADLINE)
    if rec.conversation is not None and conversation_tokens is None:
        return End(FinishReason.ERROR, error=f"{why}; its conversation was closed")
    # A conversation's answer resumes from the conversation: its tokens before the answer
    # (the head's copy) plus the answer so far.
    before = conversation_tokens[:rec.conversation_base] if rec.conversation is not None else rec.prompt
    begins = rec.conversation_base if rec.conversation is not None else len(rec.prompt)
    constraint_from = None if params.constraint is None else \
        (begins if rec.constraint_from is None else rec.constraint_from)
    resumed = replace(params, max_tokens=None if params.max_tokens is None else params.max_tokens - produced,
                      min_tokens=max(0, params.min_tokens - produced))
    return Resubmit(tokens=list(before) + rec.output, params=resumed,
                    timeout=None if rec.deadline is None else rec.deadline - now, output_offset=produced,
                    constraint_from=constraint_from, reserve_tokens=max(0, (params.max_tokens or 0) - produced))


def translate(rec: LiveRequest, delta: RequestDelta, *, claimed: bool = False) -> None:
    """Makes a resumed replica's delta read as the original request's (in place).
    ``claimed``: the request's outcome is claimed (``RecordStore.claimed``)."""
    if not claimed:  # after a cancel or a stop, ``output`` is what was delivered
        rec.output.extend(delta.new_token_ids)
    if delta.prompt_token_ids is not None:
        if rec.prompt_sent:
            delta.prompt_token_ids = None
        rec.prompt_sent = True
    if delta.usage is not None:
        if rec.cached_tokens is None:
            rec.cached_tokens = delta.usage.cached_tokens
        if rec.resumes:  # a conversation's prompt is all of it, as its first replica counted
            prompt_tokens = rec.conversation_base if rec.conversation is not None else len(rec.prompt)
            delta.usage = Usage(prompt_tokens, rec.offset + delta.usage.completion_tokens, rec.cached_tokens)


def as_sent(rec: LiveRequest | None, info: RequestInfo, now: float) -> RequestInfo:
    """A replica's entry of a request as its client sent it: a request resumed after a
    loss shows its original prompt, its whole answer so far and its age since it was sent."""
    if rec is None or not rec.resumes:
        return info
    prompt = len(rec.prompt)
    return replace(info, prompt_tokens=prompt, prompt_computed=min(info.prompt_computed, prompt),
                   completion_tokens=rec.offset + info.completion_tokens, age_s=now - rec.arrival)
