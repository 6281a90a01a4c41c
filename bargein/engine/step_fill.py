"""Filling one step's plan: the scheduler's placement of running and waiting requests.

Split from :mod:`bargein.engine.scheduler`, which owns every piece of state used here
and calls these methods from ``schedule`` (engine thread). ``PlanFill`` is the plan being
built; ``StepBudget`` says how much more it may carry. Placing a request's tokens may
need blocks: blocks nobody computes with are reclaimed first, then a running request that
is not in this plan or one in flight is preempted (a paused one first, else the newest).
This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bargein.engine.blocks import OutOfBlocks
from bargein.engine.plan import ScheduledChunk, StepPlan
from bargein.engine.request import FinishReason, RequestEvent, RequestStatus
from bargein.engine.step_budget import StepBudget

if TYPE_CHECKING:
    from bargein.engine.scheduler import Scheduler


@dataclass
class PlanFill:
    """The plan being filled by one ``schedule`` call."""

    room: int  # sequences the plan may still take
    taken: set[str]  # requests not to schedule again, nor preempt: in flight, paused, placed
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: bool = False
    prompts_left: int = 1  # prompts still to place (a timed step shares its time among them)
    continued_prompt: bool = False  # a running prompt's chunk is placed: later ones are owed nothing

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.taken.add(chunk.request_id)


class StepFilling:
    """The scheduler's placement methods (mixed into ``Scheduler``)."""

    def _continue_running(self: Scheduler, fill: PlanFill, budget: StepBudget, *, decodes: bool = True,
                          prompts: bool = True) -> None:
        """Places running requests' next tokens (their decodes, their prompts' chunks, or both)."""
        for req in list(self.running):
            if len(fill.chunks) >= fill.room:
                break
            if req.status != RequestStatus.RUNNING or budget.exhausted or req.request_id in fill.taken:
                continue
            seq = req.sequence
            is_prompt = seq.num_pending > 1
            if not (prompts if is_prompt else decodes):
                continue
            n = budget.take(seq.num_pending, seq.num_computed, fill.prompts_left, owed=not fill.continued_prompt)
            fill.prompts_left -= is_prompt
            if n == 0:
                continue
            fill.continued_prompt |= is_prompt
            while req.status == RequestStatus.RUNNING:
                try:
                    fill.copies += self.pool.ensure_writable(seq.block_table, seq.num_computed, seq.num_computed + n)
                except OutOfBlocks:
                    if self._reclaim_blocks():
                        continue
                    victim = self._preemption_victim(fill.taken - (self.paused - self.in_flight))
                    if victim is None and self._in_flight:
                        break  # the plans in flight may end and free blocks: try again then
                    if victim is None or (victim is req and len(self.running) == 1):
                        self._finish(req, FinishReason.ERROR, error="the KV cache is too small for this sequence")
                        break
                    self._preempt(victim)
                    fill.preempted = True
                    continue
                budget.spend(n, seq.num_computed, prompt=seq.num_pending > 1)
                fill.add(self._chunk(req, n))
                break

    def _admit_waiting(self: Scheduler, fill: PlanFill, budget: StepBudget) -> None:
        """Admits waiting requests, oldest first, while the step has room."""
        i = 0  # the waiting request to admit next: the oldest, or one past prompts with no room
        while (i < len(self.waiting) and not fill.preempted and not budget.exhausted and len(fill.chunks) < fill.room
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[i]
            if req.request_id in self.held or req.request_id in self.paused:
                # Its K/V is being read from disk, or it was preempted while its consumer was not
                # reading (it waits for ``resume``): the others go on.
                i += 1
                continue
            seq = req.sequence
            first_admission = req.status == RequestStatus.WAITING
            # A request waits without blocks (they may have been reclaimed): match again.
            matched = not seq.block_table.block_ids
            copies_hit = self._match_prefix(seq) if matched else []
            n = budget.take(seq.num_pending, seq.num_computed, fill.prompts_left)
            if n == 0:
                # No room for its prompt beside the decodes: it waits (without the hits, as
                # it was), and so does every prompt after it; one with a single token to
                # compute (a cache hit) costs a decode's share and may pass.
                if matched:
                    self._drop_kv(seq)
                fill.prompts_left -= 1
                i += 1
                continue
            try:
                copies_new = self.pool.ensure_writable(seq.block_table, seq.num_computed, seq.num_computed + n)
            except OutOfBlocks:
                self._drop_kv(seq)  # waiting holds no blocks: give back the hits (and any it had)
                if self._reclaim_blocks():
                    continue
                if not self.running and not fill.chunks:
                    del self.waiting[i]
                    self._finish(req, FinishReason.ERROR, error="the KV cache is too small for this prompt")
                    continue
                break
            fill.copies += copies_hit + copies_new
            del self.waiting[i]
            fill.prompts_left -= 1
            if first_admission:
                req.cached_tokens = seq.num_computed
                self.num_prefix_hit_tokens += seq.num_computed
            self._transition(req, RequestEvent.SCHEDULE)
            budget.spend(n, seq.num_computed, prompt=seq.num_pending > 1)
            self.running.append(req)
            fill.add(self._chunk(req, n))

    def _prompt_room(self: Scheduler, busy: frozenset[str], room: int) -> float:
        """Prompt tokens this step may carry: ``max_mixed_prefill_tokens`` when it will carry
        a decode (a running sequence with one token to compute), else no cap of its own; for
        an all-local model at most the pool's ``max_chunk_tokens``, so that a sequence longer
        than the pool computes its prompt in chunks that fit beside its window."""
        chunk = self.pool.max_chunk_tokens or math.inf
        cap = self.config.max_mixed_prefill_tokens
        if cap is None:
            return chunk
        schedulable = (r for r in self.running if r.status == RequestStatus.RUNNING and r.request_id not in busy)
        has_decode = any(r.sequence.num_pending == 1 for r in itertools.islice(schedulable, room))
        return min(cap, chunk) if has_decode else chunk


    def add_drafts(self: Scheduler, plan: StepPlan, drafts: Mapping[str, tuple[int, ...]]) -> StepPlan:
        """The plan with guesses after its decode chunks (speculative decoding).

        ``drafts``: request id -> guessed tokens, for requests whose chunk in ``plan``
        (just scheduled, not submitted) decodes one token. Each guess gets a K/V slot after
        the chunk's token, in blocks made writable now; where the pool has no room the
        chunk goes without guesses (speculation never preempts). The slots of guesses the
        forward does not confirm are given back in ``update`` before anything reads them.
        """
        chunks, copies = [], list(plan.block_copies)
        for chunk in plan.chunks:
            guess = drafts.get(chunk.request_id, ())
            req = self.requests.get(chunk.request_id)
            if not guess or req is None or not chunk.sample or len(chunk.token_ids) != 1:
                chunks.append(chunk)
                continue
            table = req.sequence.block_table
            try:
                copies += self.pool.ensure_writable(table, chunk.context_len, chunk.context_len + len(guess))
            except OutOfBlocks:
                chunks.append(chunk)
                continue
            chunks.append(dataclasses.replace(chunk, draft_token_ids=tuple(guess),
                                              block_table=table.forward_ids()))
        return StepPlan(plan.step, tuple(chunks), tuple(copies))
