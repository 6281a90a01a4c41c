"""What the engine thread sends per request (deltas), and the consumer side that turns them
into :class:`RequestOutput`.

The engine thread does O(new tokens) work per request per step: it sends the new token
ids, raw log-probability data, the finish, and three usage counts. Everything that grows
with the answer (detokenizing, stop strings, packing logprobs, the cumulative token list
and text) runs on the consumer's side, in :class:`OutputProcessor`, once per request.

A stop string is found here, after the engine may have sampled further. The processor
then ends its output at the token that completed the stop and tells the engine how many
tokens were delivered (``Engine.finish``); the scheduler ends the request and truncates
its sequence to them, so a conversation keeps exactly the delivered tokens (C3) whoever
found the stop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bargein.engine.detokenizer import IncrementalDetokenizer
from bargein.engine.request import CancelReason, FinishReason, RequestOutput, TokenLogprob, Usage
from bargein.engine.sampling import SamplingParams


@dataclass
class RequestDelta:
    """One request's change in one step (or several, coalesced), engine -> consumer.

    ``new_logprobs`` has one entry per new token: the sampler's raw result (with
    ``token_id``, ``logprob`` and ``top_logprobs``), or None when none were computed.
    ``prompt_token_ids`` is set on a request's first delta only.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[Any] = field(default_factory=list)
    usage: Usage | None = None  # cumulative counts; None: unchanged (a final delta made outside the engine)
    finished: bool = False
    finish_reason: FinishReason | None = None
    cancel_reason: CancelReason | None = None
    error: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    cancel_requested: tuple[float, int] | None = None  # (monotonic time, engine step) of the cancel, for latency
    # When the engine made it (time.monotonic on its thread); a merge keeps the earlier one,
    # so a coalesced delta reports its oldest token. Comparable across processes of one host.
    emitted_at: float = field(default_factory=time.monotonic, compare=False)

    def merge(self, later: RequestDelta) -> None:
        """Folds a later delta of the same request into this one (O(its new tokens))."""
        if self.finished:
            return  # nothing follows a finish
        self.new_token_ids += later.new_token_ids
        self.new_logprobs += later.new_logprobs
        self.usage = later.usage or self.usage
        if self.prompt_token_ids is None:
            self.prompt_token_ids = later.prompt_token_ids
        if later.finished:
            self.finished, self.finish_reason = True, later.finish_reason
            self.cancel_reason, self.error = later.cancel_reason, later.error


@dataclass(frozen=True)
class StepOutcome:
    """The one result of an engine step: every request it changed, and which finished."""

    step: int
    deltas: tuple[RequestDelta, ...] = ()

    @property
    def finished(self) -> tuple[str, ...]:
        return tuple(d.request_id for d in self.deltas if d.finished)


@dataclass(frozen=True)
class Processed:
    """A processor's answer to one delta: an output to hand on (or None), and, when the
    consumer found a stop string, how many tokens it delivered (to send to the engine)."""

    output: RequestOutput | None
    stop_delivered: int | None = None


def end_found_by_consumer(engine: Any, result: Processed) -> RequestOutput | None:
    """Sends a stop string the consumer found back to the engine; returns the output to
    hand on (cancelled instead, if an abort claimed the request first)."""
    out = result.output
    if result.stop_delivered is None or out is None:
        return out
    claimed = engine.finish(out.request_id, FinishReason.STOP, delivered=result.stop_delivered)
    if claimed is not None:
        out = replace(out, finish_reason=FinishReason.CANCELLED, cancel_reason=claimed)
    return out


class OutputProcessor:
    """Turns one request's deltas into outputs; lives on the consumer's side.

    Cost per delta is O(its new tokens) (plus O(answer) once, for the last output's
    cumulative fields). After the last output, further deltas give nothing.
    """

    def __init__(self, request_id: str, params: SamplingParams, tokenizer: Any):
        self.request_id = request_id
        self._detok = IncrementalDetokenizer(tokenizer, stop=params.stop,
                                             skip_special_tokens=params.skip_special_tokens)
        self._token_ids: list[int] = []
        self._prompt: tuple[int, ...] = ()
        self._usage = Usage(0, 0, 0)
        self.finished = False

    @property
    def num_delivered(self) -> int:
        """Output tokens handed on so far (what a conversation keeps)."""
        return len(self._token_ids)

    def process(self, delta: RequestDelta) -> Processed:
        if self.finished:
            return Processed(None)
        if delta.prompt_token_ids is not None:
            self._prompt = delta.prompt_token_ids
        if delta.usage is not None:
            self._usage = delta.usage
        new: list[int] = []
        pieces: list[str] = []
        for token in delta.new_token_ids:
            new.append(token)
            pieces.append(self._detok.push(token))
            if self._detok.stop_matched is not None:
                break
        self._token_ids += new
        logprobs = tuple(TokenLogprob(t.token_id, t.logprob, t.top_logprobs)
                         for t in delta.new_logprobs[:len(new)] if t is not None and t.logprob is not None)
        if self._detok.stop_matched is not None:
            self.finished = True
            usage = Usage(self._usage.prompt_tokens, len(self._token_ids), self._usage.cached_tokens)
            out = self._output(new, pieces, logprobs, usage, FinishReason.STOP, None, None, delta.emitted_at)
            return Processed(out, stop_delivered=len(self._token_ids))
        if delta.finished:
            self.finished = True
            pieces.append(self._detok.flush())
            return Processed(self._output(new, pieces, logprobs, self._usage, delta.finish_reason,
                                          delta.cancel_reason, delta.error, delta.emitted_at))
        if not new:
            return Processed(None)
        return Processed(self._output(new, pieces, logprobs, self._usage, None, None, None, delta.emitted_at))

    def _output(self, new: list[int], pieces: list[str], logprobs: tuple[TokenLogprob, ...], usage: Usage,
                reason: FinishReason | None, cancel_reason: CancelReason | None, error: str | None,
                emitted_at: float | None) -> RequestOutput:
        final = self.finished
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=tuple(new),
            token_ids=tuple(self._token_ids) if final else (),
            delta_text="".join(pieces),
            text=self._detok.text if final else "",
            finished=final,
            finish_reason=reason,
            usage=usage,
            cancel_reason=cancel_reason if reason == FinishReason.CANCELLED else None,
            error=error,
            new_logprobs=logprobs,
            prompt_token_ids=self._prompt if final else (),
            emitted_at=emitted_at,
        )


class OutputCollector:
    """The synchronous consumer: steps an :class:`Engine` and processes its deltas.

    For callers that drive the engine themselves (``Engine.generate``, tests, benches)::

        collector = OutputCollector(engine)
        rid = collector.add_request(prompt, params)
        outputs = collector.step()   # list[RequestOutput]

    A stop string found here is sent back with ``engine.finish``; the engine applies it
    at its next step, and ``collector.pending`` stays true until it has.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self._processors: dict[str, OutputProcessor] = {}
        self._engine_open: set[str] = set()  # requests the engine has not reported finished

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs: Any) -> str:
        params = params or SamplingParams()
        rid = self.engine.add_request(prompt, params, **kwargs)
        self._processors[rid] = OutputProcessor(rid, params, self.engine.tokenizer)
        self._engine_open.add(rid)
        return rid

    def watch(self, request_id: str, params: SamplingParams) -> None:
        """Processes a request added to the engine directly."""
        self._processors[request_id] = OutputProcessor(request_id, params, self.engine.tokenizer)
        self._engine_open.add(request_id)

    @property
    def pending(self) -> bool:
        return bool(self._engine_open)

    def step(self) -> list[RequestOutput]:
        return self.process(self.engine.step())

    def process(self, outcome: StepOutcome) -> list[RequestOutput]:
        outputs = []
        for delta in outcome.deltas:
            if delta.finished:
                self._engine_open.discard(delta.request_id)
            processor = self._processors.get(delta.request_id)
            if processor is None:
                continue
            out = end_found_by_consumer(self.engine, processor.process(delta))
            if out is not None:
                outputs.append(out)
            if processor.finished:
                del self._processors[delta.request_id]
        return outputs
