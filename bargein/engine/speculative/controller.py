"""The engine's speculation: who guesses, how many guesses, and what it earned.

``Speculation.extend(plan, scheduler)`` runs after ``schedule`` and before ``submit``: it
asks the proposer for guesses for the plan's decode chunks and has the scheduler place
them (``Scheduler.add_drafts``); ``observe(plan, tokens)`` runs after verification and
adapts each request's k. It never changes which tokens a request gets, only how many
come per step.

Who: a decode chunk of a request that did not opt out (``SamplingParams.speculative``)
and whose sampling is plain (``verify.can_verify``). When: while the step carries at most
``max_batch`` decode rows (a wider batch already reads each weight once for many rows, so
guesses add compute without saving reads) and the token budget has room. How many: k
starts at ``max_draft_tokens``, doubles after a step that confirmed every guess and drops
to one more than the confirmed run after a miss; a request whose guesses mostly miss
(acceptance below ``_MIN_ACCEPTANCE``, a moving average) rests for a few steps, longer
each time, so a chat that repeats nothing costs next to nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bargein.config import SpeculativeConfig
from bargein.engine.plan import StepPlan
from bargein.engine.speculative.proposer import DraftRequest, Proposer
from bargein.engine.speculative.verify import can_verify

if TYPE_CHECKING:
    from bargein.engine.scheduler import Scheduler

_MIN_ACCEPTANCE = 0.3  # below this moving acceptance rate a request rests
_EMA = 0.3  # weight of the newest step in the moving acceptance rate
_MAX_REST = 32  # steps


@dataclass
class _Pace:
    """One request's speculation pace."""

    k: int
    acceptance: float = 1.0  # moving average of confirmed / guessed
    rest: int = 0  # decode steps to skip before guessing again
    rests: int = 0  # times it rested (each rest is longer)


@dataclass(frozen=True)
class SpeculationCounts:
    """Totals since the engine started (``/metrics``)."""

    drafted_tokens: int  # guesses verified
    accepted_tokens: int  # guesses confirmed (their tokens were delivered unless a cancel or a stop came first)
    verify_steps: int  # chunks that carried guesses


class Speculation:
    """Owns the per-request pace and the counts; the proposer owns its own state."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, *, max_num_batched_tokens: int):
        self.config, self.proposer = config, proposer
        self.max_num_batched_tokens = max_num_batched_tokens
        self._pace: dict[str, _Pace] = {}
        self.drafted_tokens = self.accepted_tokens = self.verify_steps = 0

    def counts(self) -> SpeculationCounts:
        return SpeculationCounts(self.drafted_tokens, self.accepted_tokens, self.verify_steps)

    def extend(self, plan: StepPlan, scheduler: Scheduler) -> StepPlan:
        """``plan`` with guesses after the decode chunks that should speculate now."""
        decodes = [c for c in plan.chunks if c.sample and len(c.token_ids) == 1]
        if not decodes or len(decodes) > self.config.max_batch:
            return plan
        room = self.max_num_batched_tokens - plan.num_tokens
        asks = []
        for chunk in decodes:
            req = scheduler.requests.get(chunk.request_id)
            if req is None or not req.params.speculative or not can_verify(req.sampling):
                continue
            pace = self._pace.setdefault(req.request_id, _Pace(self.config.max_draft_tokens))
            if pace.rest:
                pace.rest -= 1
                continue
            k = min(pace.k, room, scheduler.max_model_len - chunk.context_len - 1)
            if req.params.max_tokens is not None:
                k = min(k, req.params.max_tokens - req.num_output_tokens - 1)  # the last token needs no guess
            if k < 1:
                continue
            room -= k
            asks.append(DraftRequest(req.request_id, req.sequence.token_ids, k))
        if not asks:
            return plan
        drafts = self.proposer.propose(asks)
        return scheduler.add_drafts(plan, drafts) if drafts else plan

    def observe(self, plan: StepPlan, tokens: Mapping[str, object]) -> None:
        """Adapts each verified request's k to what its verification confirmed."""
        for chunk in plan.chunks:
            guessed = len(chunk.draft_token_ids)
            pace = self._pace.get(chunk.request_id)
            confirmed = tokens.get(chunk.request_id)
            if not guessed or pace is None or not isinstance(confirmed, tuple):
                continue
            accepted = len(confirmed) - 1
            self.drafted_tokens += guessed
            self.accepted_tokens += accepted
            self.verify_steps += 1
            pace.acceptance = (1 - _EMA) * pace.acceptance + _EMA * accepted / guessed
            if accepted == guessed:
                pace.k = min(self.config.max_draft_tokens, 2 * pace.k)
            else:
                pace.k = max(1, accepted + 1)
            if pace.acceptance < _MIN_ACCEPTANCE:
                pace.rests += 1
                pace.rest = min(_MAX_REST, 2 ** pace.rests)
                pace.acceptance = _MIN_ACCEPTANCE  # one confirmed step after the rest keeps it going

    def forget(self, request_id: str) -> None:
        """The request ended: its pace and the proposer's state for it go."""
        self._pace.pop(request_id, None)
        self.proposer.forget(request_id)
