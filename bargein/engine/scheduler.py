"""The scheduler: decides what each step computes, and owns every request's lifecycle.

One accounting covers everything: a sequence has ``num_tokens`` tokens of which the
first ``num_computed`` have K/V; a step computes some pending tokens of some sequences.
A fresh prompt, a prompt chunk, a prefix-cache hit and a decode are all that one rule.

Each step takes, within a token budget, the pending tokens of running requests (oldest
first; one token for a decode, a chunk for a long prompt) and then admits waiting
requests. When blocks run out it first reclaims blocks held by idle conversations,
then preempts the newest running request (its blocks are released, its tokens kept,
and it is recomputed later, usually from the prefix cache).

Cancellation (contract C1-C3): ``abort`` finishes a queued request at once, without
compute. A request in the step in flight is finished in ``update``: its K/V computed in
that step is kept, and the token sampled in it is dropped, so nothing sampled after the
cancel reaches the caller.

Conversations keep a *session*: a sequence that outlives its requests, with its
blocks, so the next turn computes only the new tokens.

This module imports no torch; it is driven by one thread (the engine's).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from bargein.config import SchedulerConfig
from bargein.engine.blocks import BlockPool, BlockTable, OutOfBlocks
from bargein.engine.plan import ScheduledChunk, StepPlan
from bargein.engine.request import (
    AbortResult,
    CancelReason,
    FinishReason,
    Request,
    RequestStatus,
    Sequence,
)


class SessionBusy(Exception):
    """A conversation was changed while a request is generating on it."""


class UnknownSession(KeyError):
    pass


@dataclass
class Session:
    """A conversation's sequence between requests. ``active`` is the request on it, if any."""

    sequence: Sequence
    active: Request | None = None
    last_used: float = 0.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, max_model_len: int,
                 eos_token_ids: frozenset[int]):
        self.config = config
        self.pool = pool
        self.max_model_len = min(max_model_len, pool.num_blocks * pool.block_size)
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.sessions: dict[str, Session] = {}
        self._in_flight: set[str] = set()
        self._finished_log: list[Request] = []  # finished since the last drain_finished()
        self._step = 0
        self.num_preemptions = 0
        self.num_reclaimed_sessions = 0
        self.num_computed_tokens = 0  # tokens computed by forwards, ever (counters for tests and stats)
        self.num_prefix_hit_tokens = 0

    # -- requests -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queues a request; raises ValueError if it can never fit."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        seq = request.sequence
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt is {seq.num_tokens} tokens, but the context holds {self.max_model_len} "
                f"(room is needed for at least one generated token)"
            )
        if seq.num_pending == 0:
            # Everything is computed (a cancel dropped the last sample): recompute the
            # last token, whose logits are needed to sample the next one.
            seq.num_computed = seq.num_tokens - 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str, reason: CancelReason) -> AbortResult:
        """Cancels an unfinished request; idempotent, and NOT_FOUND for any other id.

        Telling "finished" from "never seen" (C6) is the engine's job: it owns the
        registry of request ids that every thread reads.
        """
        req = self.requests.get(request_id)
        if req is None:
            return AbortResult.NOT_FOUND
        if req.cancel_reason is None:
            req.cancel_reason = reason
        if request_id not in self._in_flight:
            self._finish(req, FinishReason.CANCELLED, cancel_reason=req.cancel_reason)
        # else: finished in update(), after the step in flight, keeping its K/V.
        return AbortResult.CANCELLED

    def finish_request(self, request_id: str, reason: FinishReason, *, error: str | None = None) -> None:
        """Ends a request between steps (a stop string matched, or an error)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, reason, error=error)

    def expire_deadlines(self, now: float | None = None) -> list[Request]:
        """Cancels requests whose deadline passed; returns them (finished or pending finish)."""
        now = time.monotonic() if now is None else now
        expired = [r for r in self.requests.values()
                   if r.deadline is not None and r.deadline <= now and r.cancel_reason is None]
        for req in expired:
            self.abort(req.request_id, CancelReason.DEADLINE)
        return expired

    def drain_finished(self) -> list[Request]:
        """Requests finished since the last call, in the order they finished."""
        finished, self._finished_log = self._finished_log, []
        return finished

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Picks this step's work; the plan's requests are in flight until update()."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        copies: list[tuple[int, int]] = []
        preempted = False
        scheduled: set[str] = set()

        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            seq = req.sequence
            n = min(seq.num_pending, budget)
            if n == 0:
                continue
            while req.status == RequestStatus.RUNNING:
                try:
                    copies += self.pool.ensure_writable(seq.block_table, seq.num_computed, seq.num_computed + n)
                except OutOfBlocks:
                    if self._reclaimidle_session():
                        continue
                    victim = self.running[-1]
                    if victim is req and len(self.running) == 1:
                        self._finish(req, FinishReason.ERROR,
                                     error="the KV cache is too small for this sequence")
                        break
                    self._preempt(victim)
                    preempted = True
                    continue
                chunks.append(self._chunk(req, n))
                scheduled.add(req.request_id)
                budget -= n
                break

        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            seq = req.sequence
            first_admission = req.status == RequestStatus.WAITING
            matched = not seq.block_table.block_ids
            if matched:
                self._match_prefix(seq)
            n = min(seq.num_pending, budget)
            try:
                copies += self.pool.ensure_writable(seq.block_table, seq.num_computed, seq.num_computed + n)
            except OutOfBlocks:
                if matched:  # give the prefix hits back while it waits: waiting holds no blocks
                    self._drop_kv(seq)
                if self._reclaimidle_session():
                    continue
                if not self.running and not chunks:
                    self.waiting.popleft()
                    self._finish(req, FinishReason.ERROR, error="the KV cache is too small for this prompt")
                    continue
                break
            self.waiting.popleft()
            if first_admission:
                req.cached_tokens = seq.num_computed
                self.num_prefix_hit_tokens += seq.num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            scheduled.add(req.request_id)
            budget -= n

        self._in_flight = scheduled
        self._step += 1
        return StepPlan(self._step, tuple(chunks), tuple(copies))

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Applies a finished step; returns the requests whose state changed.

        ``sampled`` maps each sampling chunk's request id to its token. Requests
        cancelled during the step are finished here, without their sampled token.
        """
        changed: list[Request] = []
        for chunk in plan.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None:
                continue
            seq = req.sequence
            seq.num_computed = chunk.context_len
            self.num_computed_tokens += len(chunk.token_ids)
            self.pool.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
            if req.cancel_reason is not None:
                self._finish(req, FinishReason.CANCELLED, cancel_reason=req.cancel_reason)
                changed.append(req)
                continue
            if not chunk.sample:
                continue
            token = sampled[chunk.request_id]
            seq.token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            changed.append(req)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
        self._in_flight = set()
        return changed

    def fail_step(self, plan: StepPlan, error: str) -> None:
        """Ends the requests of a step whose forward failed; their K/V is left as it was.

        Nothing the failed step wrote is counted as computed, so a conversation keeps
        exactly its tokens and recomputes the rest with its next prompt (C3).
        """
        for chunk in plan.chunks:
            req = self.requests.get(chunk.request_id)
            if req is not None:
                self._finish(req, FinishReason.ERROR, error=error)
        self._in_flight = set()

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        is_stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        if is_stop_token and req.num_output_tokens >= params.min_tokens:
            return FinishReason.STOP
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if req.sequence.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        seq = req.sequence
        start = seq.num_computed
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=tuple(seq.token_ids[start:start + n]),
            start_pos=start,
            block_table=tuple(seq.block_table.block_ids),
            sample=start + n == seq.num_tokens,
        )

    def _match_prefix(self, seq: Sequence) -> None:
        # Leave at least the last token to compute: its logits are needed to sample.
        max_blocks = (seq.num_tokens - 1) // self.pool.block_size
        hits = self.pool.match_prefix(seq.block_table, seq.token_ids, max_blocks)
        seq.num_computed = hits * self.pool.block_size

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_kv(req.sequence)
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _drop_kv(self, seq: Sequence) -> None:
        """Releases a sequence's blocks, keeping its tokens; they are recomputed (or hit) later."""
        self.pool.release(seq.block_table)
        seq.num_computed = 0

    def _reclaimidle_session(self) -> bool:
        """Frees the blocks of the least recently used idle conversation, if any holds some."""
        idle = [s for s in self.sessions.values() if s.active is None and s.sequence.block_table.block_ids]
        if not idle:
            return False
        victim = min(idle, key=lambda s: s.last_used)
        self._drop_kv(victim.sequence)
        self.num_reclaimed_sessions += 1
        return True

    def _finish(self, req: Request, reason: FinishReason, *, cancel_reason: CancelReason | None = None,
                error: str | None = None) -> None:
        if req.is_finished:
            return
        req.finish(reason, cancel_reason=cancel_reason, error=error)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        del self.requests[req.request_id]
        self._finished_log.append(req)
        if req.owns_sequence:
            self.pool.release(req.sequence.block_table)
        else:
            session = self.sessions[req.sequence.seq_id]
            session.active = None
            session.last_used = time.monotonic()

    # -- sessions (conversations) ----------------------------------------------------
    def open_session(self, seq_id: str, token_ids: Iterable[int] = ()) -> Sequence:
        if seq_id in self.sessions:
            raise ValueError(f"session {seq_id!r} already exists")
        seq = Sequence(seq_id, list(token_ids))
        self.sessions[seq_id] = Session(seq, last_used=time.monotonic())
        return seq

    def session(self, seq_id: str) -> Session:
        try:
            return self.sessions[seq_id]
        except KeyError:
            raise UnknownSession(seq_id) from None

    def idle_session(self, seq_id: str) -> Session:
        session = self.session(seq_id)
        if session.active is not None:
            raise SessionBusy(f"conversation {seq_id!r} is generating (request {session.active.request_id!r})")
        return session

    def start_session_request(self, request: Request) -> None:
        """Queues a request that generates onto its (idle) session's sequence."""
        session = self.idle_session(request.sequence.seq_id)
        self.add(request)
        session.active = request

    def fork_session(self, seq_id: str, new_id: str) -> Sequence:
        """A new session with the same tokens, sharing every block (copy on write)."""
        src = self.idle_session(seq_id).sequence
        if new_id in self.sessions:
            raise ValueError(f"session {new_id!r} already exists")
        seq = Sequence(new_id, list(src.token_ids), src.num_computed, self.pool.fork(src.block_table))
        self.sessions[new_id] = Session(seq, last_used=time.monotonic())
        return seq

    def truncate_session(self, seq_id: str, num_tokens: int) -> None:
        """Keeps the first ``num_tokens`` tokens (and their K/V) of an idle session."""
        seq = self.idle_session(seq_id).sequence
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"cannot keep {num_tokens} of {seq.num_tokens} tokens")
        del seq.token_ids[num_tokens:]
        seq.num_computed = min(seq.num_computed, num_tokens)
        self.pool.truncate(seq.block_table, num_tokens)

    def close_session(self, seq_id: str) -> None:
        """Releases a session's blocks; aborting its request first is the caller's job."""
        session = self.idle_session(seq_id)
        self.pool.release(session.sequence.block_table)
        del self.sessions[seq_id]

    def live_block_tables(self) -> list[BlockTable]:
        """Every block table that holds references: for the C5 accounting check."""
        tables = {id(r.sequence): r.sequence.block_table for r in self.requests.values()}
        tables |= {id(s.sequence): s.sequence.block_table for s in self.sessions.values()}
        return list(tables.values())
