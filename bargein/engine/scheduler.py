"""The scheduler: decides what each step computes, and owns every request's lifecycle.

One accounting covers everything: a sequence has ``num_tokens`` tokens of which the
first ``num_computed`` have K/V; a step computes some pending tokens of some sequences.
A fresh prompt, a prompt chunk, a prefix-cache hit and a decode are all that one rule.

Each step takes, within a token budget, the pending tokens of running requests (oldest
first; one token for a decode, a chunk for a long prompt) and then admits waiting
requests. With a time target (``max_step_ms``) the step is fair instead: decodes, then a
first chunk of every waiting request, then the next chunks of running prompts (oldest first), each sized
from measured step times (``step_budget.py``, ``step_time.py``); the placement itself is
in ``step_fill.py``. Requests whose consumer stopped reading are paused (``pause``). When blocks run out it first takes back blocks that nobody is computing with
(waiting requests' and idle conversations'), then preempts the newest running request
(its blocks are released, its tokens kept, and it is recomputed later, usually from the
prefix cache).

Ownership: a request's status changes only in :func:`~bargein.engine.request.transition`,
called from ``_transition`` here, following the table ``TRANSITIONS`` in request.py.
Every end of a request goes through ``finish(ids, reason)`` (a stop token, max_tokens, a
stop string found by the consumer, a cancel, a deadline, an error), and every change is
reported once, in the :class:`StepOutcome` that ``take_outcome`` returns at the end of
the step.

Cancellation (contract C1-C3): a queued request is finished at once, without compute. A
request in a plan in flight is finished when that plan's results come back
(``update``): its K/V computed in that step is kept, and the token sampled in it is
dropped, so nothing sampled after the cancel reaches the caller. ``finish`` may carry
``delivered``, the number of output tokens the consumer was handed: the sequence is cut
to them (after a stop string, or a consumer that walked away), so a conversation holds
exactly what its caller saw.

Conversations (``conversations.py``) keep a sequence that outlives its requests, with
its blocks. This module imports no torch; it is driven by one thread (the engine's).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, KeysView
from dataclasses import dataclass
from typing import Any

from bargein.config import SchedulerConfig
from bargein.engine.admission import check_length
from bargein.engine.blocks import BlockPool, BlockTable
from bargein.engine.conversations import HeldConversation, SchedulerConversations
from bargein.engine.outputs import RequestDelta, StepOutcome
from bargein.engine.plan import ScheduledChunk, StepPlan
from bargein.engine.request import (
    FINISH_EVENTS,
    CancelReason,
    FinishReason,
    Request,
    RequestEvent,
    RequestStatus,
    Sequence,
    transition,
)
from bargein.engine.request_ids import RequestIds
from bargein.engine.step_budget import StepBudget
from bargein.engine.step_fill import PlanFill, StepFilling
from bargein.engine.step_time import StepTimer


@dataclass(frozen=True)
class _Finish:
    """A finish waiting for the plan in flight to come back."""

    reason: FinishReason
    cancel_reason: CancelReason | None
    error: str | None
    delivered: int | None


Transition = tuple[str, RequestStatus, RequestEvent, RequestStatus]


class Scheduler(StepFilling, SchedulerConversations):
    """See the module doc; its conversations' operations are in ``conversations``."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, max_model_len: int,
                 eos_token_ids: frozenset[int]):
        self.config, self.pool = config, pool
        self.max_model_len = min(max_model_len, pool.max_sequence_tokens or max_model_len)  # all-local: no bound
        self.eos_token_ids = eos_token_ids
        self.ids = RequestIds()  # the one memory of request ids, readable from any thread
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.conversations: dict[str, HeldConversation] = {}
        self._in_flight: dict[int, frozenset[str]] = {}  # plan step -> its requests
        self._planned_at: dict[int, float] = {}  # plan step -> perf_counter() when it was planned
        self._pending_finish: dict[str, _Finish] = {}  # finishes of requests in flight
        self._changed: dict[str, tuple[Request, RequestDelta]] = {}  # this step's deltas
        self._step = 0
        self.on_transition: Callable[[Transition], Any] | None = None  # a hook for tests and tracing
        self.num_preemptions = self.num_reclaimed_conversations = 0  # counters, ever (tests and stats)
        self.num_computed_tokens = self.num_prefix_hit_tokens = 0  # tokens computed by forwards; prefix hits
        self.held: set[str] = set()  # waiting requests not admitted yet: engine/disk_cache.py reads their K/V
        self.paused_since: dict[str, float] = {}  # request -> monotonic time its consumer stopped reading
        self.step_timer = StepTimer()  # measured step times (the engine feeds it), for ``max_step_ms``

    # -- the lifecycle ----------------------------------------------------------------
    def _transition(self, req: Request, event: RequestEvent) -> None:
        old, new = transition(req, event)
        if self.on_transition is not None:
            self.on_transition((req.request_id, old, event, new))

    def check_length(self, num_tokens: int, what: str = "the prompt") -> None:
        """``admission.check_length`` against this scheduler's context; any thread."""
        check_length(num_tokens, self.max_model_len, what)

    def add(self, request: Request) -> None:
        """Queues a request whose id was claimed in ``ids``; raises ValueError if it can never fit."""
        seq = request.sequence
        if not seq.token_ids:
            raise ValueError("the prompt is empty")
        self.check_length(seq.num_tokens)
        if seq.num_pending == 0:
            # Everything is computed (a cancel dropped the last sample): recompute the
            # last token, whose logits are needed to sample the next one.
            seq.num_computed = seq.num_tokens - 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reject(self, request: Request, error: str) -> None:
        """Ends a request that could not be admitted; it never held blocks."""
        self.ids.settle(request.request_id)
        self._transition(request, RequestEvent.FAIL)
        request.finish_reason, request.error = FinishReason.ERROR, error
        self._record_finish(request)

    def finish(self, ids: Iterable[str], reason: FinishReason, *, cancel_reason: CancelReason | None = None,
               error: str | None = None, delivered: int | None = None) -> None:
        """The one way a request ends. Unknown or finished ids are ignored, except that a
        late ``delivered`` still cuts an idle conversation to what its caller was handed.

        A request in a plan in flight ends when that plan comes back (``update``).
        """
        for request_id in ids:
            req = self.requests.get(request_id)
            if req is None:
                if delivered is not None:
                    self._cut_idle_conversation(request_id, delivered)
                continue
            if self._is_in_flight(request_id):
                earlier = self._pending_finish.get(request_id)
                if earlier is None or (delivered is not None and earlier.delivered is None):
                    self._pending_finish[request_id] = _Finish(reason, cancel_reason, error, delivered)
                continue
            self._finish(req, reason, cancel_reason=cancel_reason, error=error, delivered=delivered)

    def expire_deadlines(self, now: float | None = None) -> None:
        """Cancels requests whose deadline passed (reason ``deadline``)."""
        now = time.monotonic() if now is None else now
        expired = [rid for rid, r in self.requests.items()
                   if r.deadline is not None and r.deadline <= now and rid not in self._pending_finish]
        self.finish(expired, FinishReason.CANCELLED, cancel_reason=CancelReason.DEADLINE)

    def take_outcome(self) -> StepOutcome:
        """Everything that changed since the last call, once: the step's one result."""
        changed, self._changed = self._changed, {}
        deltas = []
        for req, delta in changed.values():
            if not req.prompt_reported:
                req.prompt_reported = True
                delta.prompt_token_ids = tuple(req.sequence.token_ids[:req.prompt_len])
            delta.usage = req.usage()
            deltas.append(delta)
        return StepOutcome(self._step, tuple(deltas))

    def pause(self, request_id: str) -> None:
        """Stops scheduling a running request (its consumer's buffer is full); it keeps its
        blocks and tokens, and goes on from there after ``resume``. Unknown ids are ignored."""
        if request_id in self.requests:
            self.paused_since.setdefault(request_id, time.monotonic())

    def resume(self, request_id: str) -> None:
        self.paused_since.pop(request_id, None)

    @property
    def paused(self) -> KeysView[str]:
        """Requests whose consumer stopped reading (``pause``): not scheduled."""
        return self.paused_since.keys()

    @property
    def has_work(self) -> bool:
        """Something to schedule or to collect. Paused requests wait for ``resume``, unless
        their deadline passed (a step then ends them)."""
        if self._in_flight:
            return True
        now = time.monotonic()
        return any(r.request_id not in self.paused or (r.deadline is not None and r.deadline <= now)
                   for r in itertools.chain(self.running, self.waiting))

    @property
    def in_flight(self) -> frozenset[str]:
        """Requests in some plan in flight."""
        return frozenset().union(*self._in_flight.values()) if self._in_flight else frozenset()

    def _is_in_flight(self, request_id: str) -> bool:
        return any(request_id in ids for ids in self._in_flight.values())

    def _delta(self, req: Request) -> RequestDelta:
        entry = self._changed.get(req.request_id)
        if entry is None:
            entry = self._changed[req.request_id] = (req, RequestDelta(req.request_id))
        return entry[1]

    # -- one step -----------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None) -> StepPlan:
        """Picks this step's work; the plan's requests are in flight until its ``update``.

        A request already in a plan in flight is not scheduled again (no sequence is in
        two plans at once), so a runner may hold several plans. ``max_seqs`` caps the
        plan's sequences (a pipeline splits its running sequences into micro-batches).
        Paused requests (``pause``: their consumer stopped reading) are skipped.

        Without a time target, running requests come first (oldest first), then waiting
        ones. With ``max_step_ms`` the step is fair: decodes first, then a first chunk
        for every waiting request, then the running prompts' next chunks, oldest first,
        each sized by ``StepBudget`` so the step's modelled time stays under the target.
        """
        room = self.config.max_num_seqs if max_seqs is None else max_seqs
        busy = self.in_flight | self.paused
        budget = StepBudget.for_step(self.config.max_num_batched_tokens, self._prompt_room(busy, room),
                                     self.config.max_step_ms, self.step_timer)
        fill = PlanFill(room, set(busy))
        if budget.timed:
            # Waiting requests share the time with the running prompts, which take their
            # part in turn, oldest first: sharing it among them all would leave every long
            # prompt half read under a steady stream of them, none answered (issue 34).
            waits = self.held | self.paused
            fill.prompts_left = sum(1 for r in self.waiting if r.request_id not in waits) + any(
                r.request_id not in busy and r.sequence.num_pending > 1 for r in self.running)
            self._continue_running(fill, budget, prompts=False)
            self._admit_waiting(fill, budget)
            self._continue_running(fill, budget, decodes=False)
        else:
            self._continue_running(fill, budget)
            self._admit_waiting(fill, budget)
        self._step += 1
        if fill.chunks:
            self._in_flight[self._step] = frozenset(c.request_id for c in fill.chunks)
            self._planned_at[self._step] = time.perf_counter()
        return StepPlan(self._step, tuple(fill.chunks), tuple(fill.copies))

    def update(self, plan: StepPlan, sampled: dict[str, Any]) -> None:
        """Applies a plan whose forward finished; the changes go into the step's outcome.

        ``sampled`` maps each sampling chunk's request id to its sampled token (an object
        with ``token_id``, and the raw log-probabilities the consumer packs), or, for a
        chunk with guesses, to the tuple of tokens its verification confirmed (guesses
        1..m and the token after them). Requests finished while the plan was in flight end
        here, without their sampled tokens. A chunk's guesses count as computed only where
        confirmed; the blocks past the sequence's tokens are given back (C3).
        """
        self._in_flight.pop(plan.step, None)
        self._measure(plan)
        for chunk in plan.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None:
                continue
            seq = req.sequence
            seq.num_computed = chunk.context_len
            self.num_computed_tokens += len(chunk.token_ids)
            self.pool.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
            self.pool.drop_outside_window(seq.block_table, seq.num_computed)  # all-local models (block_window.py)
            pending = self._pending_finish.pop(chunk.request_id, None)
            if pending is not None:
                self._finish(req, pending.reason, cancel_reason=pending.cancel_reason, error=pending.error,
                             delivered=pending.delivered)
            elif not chunk.sample:
                continue
            elif self.ids.cancel_claim(req.request_id) is not None:
                # A cancel claimed this request after the inbox was read: it ends
                # cancelled, as its abort answered, and this token is not delivered (C2).
                self._finish(req, FinishReason.CANCELLED)
            else:
                value = sampled[chunk.request_id]
                self._append_sampled(req, value if isinstance(value, tuple) else (value,))
            if chunk.draft_token_ids:
                self._drop_unconfirmed(seq)

    def _append_sampled(self, req: Request, tokens: tuple[Any, ...]) -> None:
        """Appends a step's sampled tokens, in order, up to the first that ends the request.
        All but the last were computed in the step (confirmed guesses): their K/V is kept."""
        seq = req.sequence
        for j, token in enumerate(tokens):
            reason = self._stop_reason(req, token.token_id)
            seq.token_ids.append(token.token_id)
            if j < len(tokens) - 1:
                seq.num_computed += 1
                self.num_computed_tokens += 1
            if req.sampling is not None and not req.sampling.accept(token.token_id):
                reason = FinishReason.ERROR  # unreachable while masks hold; never a silent pass
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            delta = self._delta(req)
            delta.new_token_ids.append(token.token_id)
            delta.new_logprobs.append(token)
            req.num_reported += 1
            if reason is not None:
                break
        if len(tokens) > 1:
            self.pool.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
        if reason == FinishReason.ERROR:
            self._finish(req, reason, error="the sampled token does not match the request's grammar")
        elif reason is not None:
            self._finish(req, reason)

    def _drop_unconfirmed(self, seq: Sequence) -> None:
        """Gives back the blocks past a sequence's tokens, which only unconfirmed guesses
        wrote. Slots of such guesses in its last kept block lie past ``num_computed``: the
        next chunk of the sequence writes them before any attention reads them."""
        self.pool.truncate(seq.block_table, seq.num_tokens)

    def _measure(self, plan: StepPlan) -> None:
        """Feeds the step timer: planned to applied is one step's time (forward, sampling and
        the inbox; with several plans in flight, also the wait behind the others)."""
        planned_at = self._planned_at.pop(plan.step, None)
        if planned_at is not None:
            self.step_timer.observe_plan(plan, time.perf_counter() - planned_at)

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """Ends the requests of a step whose forward failed; their K/V is left as it was.

        Nothing the failed step wrote is counted as computed, so a conversation keeps
        exactly its tokens and recomputes the rest with its next prompt (C3).
        """
        self._in_flight.pop(plan.step, None)
        self._planned_at.pop(plan.step, None)
        for chunk in plan.chunks:
            self._pending_finish.pop(chunk.request_id, None)
            req = self.requests.get(chunk.request_id)
            if req is not None:
                self._drop_unconfirmed(req.sequence)  # a no-op unless the chunk had guesses
                self._finish(req, FinishReason.ERROR, error=error)

    def invalidate_kv(self) -> int:
        """Every block's K/V is gone (a pipeline stage was lost): the plans in flight are
        void, and every sequence, running, waiting or an idle conversation, keeps its
        tokens and recomputes them. Finishes that waited for a plan in flight apply now;
        the prefix cache forgets every block. Returns the tokens whose K/V was dropped.

        Running requests are preempted (oldest stays first in the queue), so they are
        scheduled again as any preempted request, and no token is lost or repeated.
        """
        self._in_flight.clear()
        self._planned_at.clear()
        for request_id, pending in list(self._pending_finish.items()):
            req = self.requests.get(request_id)
            if req is not None:
                self._finish(req, pending.reason, cancel_reason=pending.cancel_reason, error=pending.error,
                             delivered=pending.delivered)
        self._pending_finish.clear()
        dropped = 0
        for req in reversed(list(self.running)):
            dropped += req.sequence.num_computed
            self._preempt(req)
        for req in self.waiting:
            dropped += req.sequence.num_computed
            self._drop_kv(req.sequence)
        for conversation in self.conversations.values():
            if conversation.active is None:
                dropped += conversation.sequence.num_computed
                self._drop_kv(conversation.sequence)
        self.pool.forget_contents()
        return dropped

    def fail_all(self, error: str) -> None:
        """Ends every request with ``error`` (a pipeline that cannot run); none may be in flight."""
        self.finish(list(self.requests), FinishReason.ERROR, error=error)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        n = req.num_output_tokens + 1  # counting this token
        is_stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        if is_stop_token and n >= params.min_tokens:
            return FinishReason.STOP
        if params.max_tokens is not None and n >= params.max_tokens:
            return FinishReason.LENGTH
        if req.sequence.num_tokens + 1 >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        seq = req.sequence
        start = seq.num_computed
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=tuple(seq.token_ids[start:start + n]),
            start_pos=start,
            block_table=seq.block_table.forward_ids(),
            sample=start + n == seq.num_tokens,
        )

    def _match_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        # Leave at least the last token to compute: its logits are needed to sample.
        hit, copies = self.pool.match_prefix(seq.block_table, seq.token_ids, seq.num_tokens - 1)
        seq.num_computed = hit
        return copies

    def _preemption_victim(self, busy: set[str] | frozenset[str]) -> Request | None:
        """The newest running request that is not ``busy`` (in a plan in flight or being
        planned), a paused one first: its client is not reading, so it loses least."""
        candidates = [r for r in reversed(self.running) if r.request_id not in busy]
        return next((r for r in candidates if r.request_id in self.paused), candidates[0] if candidates else None)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_kv(req.sequence)
        self._transition(req, RequestEvent.PREEMPT)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _drop_kv(self, seq: Sequence) -> None:
        """Releases a sequence's blocks, keeping its tokens; they are recomputed (or hit) later."""
        self.pool.release(seq.block_table, seq.token_ids, seq.num_computed)
        seq.num_computed = 0

    def _reclaim_blocks(self) -> bool:
        """Frees blocks nobody is computing with: a waiting request's, else the least
        recently used idle conversation's. False if none holds any."""
        for req in self.waiting:
            if req.sequence.block_table.block_ids:
                self._drop_kv(req.sequence)
                return True
        idle = [s for s in self.conversations.values() if s.active is None and s.sequence.block_table.block_ids]
        if not idle:
            return False
        victim = min(idle, key=lambda s: s.last_used)
        self._drop_kv(victim.sequence)
        self.num_reclaimed_conversations += 1
        return True

    def _finish(self, req: Request, reason: FinishReason, *, cancel_reason: CancelReason | None = None,
                error: str | None = None, delivered: int | None = None) -> None:
        if req.is_finished:
            return
        claimed = self.ids.settle(req.request_id)
        if claimed is not None:  # a cancel got there first: the request ends as its abort answered
            reason, cancel_reason, error = FinishReason.CANCELLED, claimed, None
        self._transition(req, FINISH_EVENTS[reason])
        req.finish_reason = reason
        req.cancel_reason = cancel_reason if reason == FinishReason.CANCELLED else None
        req.error = error
        if delivered is not None:
            self._cut(req.sequence, req.prompt_len + delivered)
            req.num_reported = min(req.num_reported, delivered)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        del self.requests[req.request_id]
        self._pending_finish.pop(req.request_id, None)
        self.paused_since.pop(req.request_id, None)
        if req.owns_sequence:
            seq = req.sequence
            self.pool.release(seq.block_table, seq.token_ids, seq.num_computed)
        else:
            conversation = self.conversations[req.sequence.seq_id]
            conversation.active = None
            conversation.last_used = time.monotonic()
            conversation.last_request = (req.request_id, req.prompt_len)
        self._record_finish(req)

    def _record_finish(self, req: Request) -> None:
        delta = self._delta(req)
        delta.finished, delta.finish_reason = True, req.finish_reason
        delta.cancel_reason, delta.error = req.cancel_reason, req.error
        if req.cancel_requested_at is not None and req.cancel_requested_step is not None:
            delta.cancel_requested = (req.cancel_requested_at, req.cancel_requested_step)
        self.ids.release(req.request_id)

    def _cut(self, seq: Sequence, num_tokens: int) -> None:
        """Keeps the first ``num_tokens`` tokens of a sequence (never grows it)."""
        if num_tokens >= seq.num_tokens:
            return
        if not self.pool.keeps_window(seq.block_table, num_tokens):
            self._drop_kv(seq)  # it gave back blocks its window would read again: recomputed (or hit) later
        del seq.token_ids[num_tokens:]
        seq.num_computed = min(seq.num_computed, num_tokens)
        self.pool.truncate(seq.block_table, num_tokens)

    def live_block_tables(self) -> list[BlockTable]:
        """Every block table that holds references: for the C5 accounting check."""
        tables = {id(r.sequence): r.sequence.block_table for r in self.requests.values()}
        tables |= {id(s.sequence): s.sequence.block_table for s in self.conversations.values()}
        return list(tables.values())
