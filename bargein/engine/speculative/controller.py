"""The engine's speculation: who guesses, how many guesses, and what it earned.

``Speculation.extend(plan, scheduler)`` runs after ``schedule`` and before ``submit``: it
asks the proposer for guesses for the plan's decode chunks and has the scheduler place
them (``Scheduler.add_drafts``); ``observe(plan, tokens)`` runs after verification and
updates each request's acceptance rate. It never changes which tokens a request gets,
only how many come per step.

Who: a decode chunk of a request that did not opt out (``SamplingParams.speculative``)
and whose sampling is plain (``verify.can_verify``), while the step carries at most
``max_batch`` decode rows. How many: guess i (1-based) is confirmed with probability
about ``alpha ** i``, where ``alpha`` is the request's measured rate of a guess being
right after right ones (decayed counts, so it follows the text); a guess row costs ``g``
tokens: the tokens the step yields in the time the row takes (the scheduler's fitted
step time, ``step_time.StepCost``, or a fixed ``guess_cost``). Guesses pay
while ``alpha ** i > g``, so k is the largest such i, at most ``max_draft_tokens``. A
wide batch makes ``g`` large (its decodes already share the weights' reads), so
speculation backs off by itself; a request whose guesses do not pay (k = 0) rests for a
few decode steps, longer each time, then probes with one guess, so a chat that repeats
nothing costs next to nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bargein.config import SpeculativeConfig
from bargein.engine.plan import ScheduledChunk, StepPlan
from bargein.engine.speculative.proposer import DraftRequest, Proposer
from bargein.engine.speculative.verify import can_verify
from bargein.engine.step_time import plan_features

if TYPE_CHECKING:
    from bargein.engine.scheduler import Scheduler

_DECAY = 0.8  # weight of a request's older verifications in its acceptance rate
_PRIOR = (1.6, 0.4)  # (right, wrong) guesses assumed before any verification: alpha 0.8
_MAX_REST = 32  # decode steps
_MIN_GUESS_COST = 0.1  # tokens: a guess row is never free, so guesses that always miss stop
_UNMEASURED_GUESS_COST = 0.35  # a row's time in one-row decode steps (SmolLM2, fast) until measured


@dataclass
class _Pace:
    """One request's record: decayed counts of right guesses and of misses (a miss ends a
    verification's run), and its rest."""

    right: float = _PRIOR[0]
    wrong: float = _PRIOR[1]
    rest: int = 0  # decode steps to skip before probing again
    rests: int = 0  # times it rested in a row (each rest is longer)
    probe: bool = False  # the next chance is a one-guess probe after a rest

    @property
    def alpha(self) -> float:
        return self.right / (self.right + self.wrong)

    def observe(self, guessed: int, accepted: int) -> None:
        self.right = _DECAY * self.right + accepted
        self.wrong = _DECAY * self.wrong + (accepted < guessed)
        if accepted:
            self.rests = 0  # guesses pay again: a later rest starts short


def guesses_that_pay(alpha: float, guess_cost: float, most: int) -> int:
    """The largest k <= ``most`` with ``alpha ** k > guess_cost`` (0 if none): each further
    guess is expected to bring more tokens than its row costs."""
    if guess_cost <= 0 or alpha >= 1:
        return most
    if alpha <= guess_cost:
        return 0
    return max(0, min(most, math.ceil(math.log(guess_cost) / math.log(alpha)) - 1))


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
        cost: float | None = None  # worked out once a request wants more than a probe (a resting chat never does)
        asks = []
        for chunk in decodes:
            req = scheduler.requests.get(chunk.request_id)
            if req is None or not req.params.speculative or not can_verify(req.sampling):
                continue
            pace = self._pace.setdefault(req.request_id, _Pace())
            if pace.rest:
                pace.rest -= 1
                continue
            if pace.probe:
                k, pace.probe = 1, False
            else:
                if cost is None:
                    cost = self._guess_cost(plan, scheduler, decodes)
                k = guesses_that_pay(pace.alpha, cost, self.config.max_draft_tokens)
            if k == 0:
                pace.rests += 1
                pace.rest, pace.probe = min(_MAX_REST, 2 ** pace.rests), True
                continue
            k = min(k, room, scheduler.max_model_len - chunk.context_len - 1)
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

    def _guess_cost(self, plan: StepPlan, scheduler: Scheduler, decodes: list[ScheduledChunk]) -> float:
        """What one guess row costs, in tokens: what the step yields in the row's time."""
        fitted = None if self.config.guess_cost is not None else scheduler.step_timer.cost
        n = len(decodes)
        if fitted is None:
            c = _UNMEASURED_GUESS_COST if self.config.guess_cost is None else self.config.guess_cost
            return max(_MIN_GUESS_COST, c * n / (1 + c * (n - 1)))  # the step: a decode, then n-1 rows
        step_s = fitted.seconds(*plan_features(plan))
        context = sum(c.context_len for c in decodes) / n
        row_s = fitted.per_token + fitted.per_pair * context
        return max(_MIN_GUESS_COST, row_s * n / step_s if step_s > 0 else 0.0)

    def observe(self, plan: StepPlan, tokens: Mapping[str, object]) -> None:
        """Records what each verification confirmed (its request's acceptance, the counts)."""
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
            pace.observe(guessed, accepted)

    def forget(self, request_id: str) -> None:
        """The request ended: its pace and the proposer's state for it go."""
        self._pace.pop(request_id, None)
        self.proposer.forget(request_id)
