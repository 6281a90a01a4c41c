"""What one step may still carry while the scheduler fills it: tokens, prompt room, time.

Three limits apply to every step's plan:

- ``tokens``: ``max_num_batched_tokens``, the tokens of one forward;
- ``prompt_room``: ``max_mixed_prefill_tokens`` when the step carries a decode, else none;
- ``seconds``: with ``max_step_ms``, the step's time target less the measured overhead
  of a step (``step_time.StepTimer``); each chunk spends its modelled marginal time.

A decode (one pending token) costs one token of the budget and its time, and is never
refused while a token is left. A prompt chunk is sized to the time left, split evenly
between the prompts still to be placed in this step (``share``). A chunk that is owed
progress (``owed``: a waiting request's first chunk, and the oldest running prompt's next
one) is never smaller than ``MIN_PROMPT_CHUNK`` tokens, nor than the tokens whose time
equals a step's measured fixed cost (or its whole prompt, if shorter) while the token
budget and the prompt room allow; any other chunk gets the time left, or nothing. So a
step overshoots the target only by those floors, a waiting request always gets its first
chunk into the next step, and the oldest long prefill always advances. Without a time
target the budget is the two token limits alone, as before.

Plain data and arithmetic, no torch; one instance lives for one ``schedule`` call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bargein.engine.step_time import StepCost, StepTimer

MIN_PROMPT_CHUNK = 16  # tokens a placed prompt computes at least, whatever the time left


@dataclass
class StepBudget:
    tokens: int
    prompt_room: float  # math.inf: no cap of its own
    seconds: float = math.inf  # math.inf: no time target
    cost: StepCost | None = None
    explore_limit: int | None = None  # the measured ground for a chunk's size (StepTimer)

    @classmethod
    def for_step(cls, tokens: int, prompt_room: float, target_ms: float | None, timer: StepTimer) -> StepBudget:
        """The budget of a step; timed when there is a target."""
        if target_ms is None:
            return cls(tokens, prompt_room)
        cost = timer.cost
        seconds = target_ms / 1000 - (cost.overhead if cost is not None else 0.0)
        return cls(tokens, prompt_room, seconds, cost, timer.explore_limit)

    @property
    def timed(self) -> bool:
        return self.seconds != math.inf

    @property
    def exhausted(self) -> bool:
        return self.tokens <= 0

    def take(self, pending: int, start_pos: int, share: int = 1, *, owed: bool = True) -> int:
        """Tokens of a sequence's ``pending`` (from ``start_pos``) to compute in this step.

        ``share``: the prompts still to be placed in this step, this one included; a prompt
        gets at least its even share of the time left. ``owed``: a prompt chunk gets its
        floor whatever the time left (see the module doc). 0 means it cannot be placed now.
        """
        most = min(pending, self.tokens)
        if pending == 1:
            return most
        most = int(min(most, max(self.prompt_room, 0)))
        if not self.timed or most == 0:
            return most
        n = most if self.explore_limit is None else min(most, self.explore_limit)
        floor = MIN_PROMPT_CHUNK if owed else 0
        if self.cost is not None and owed:
            # Where a step's fixed cost alone is near the target (a loaded machine), chunks
            # sized to the time left would shrink to nothing and a prompt would take forever:
            # a chunk always gets the tokens that cost as much as that fixed cost.
            floor = max(floor, min(n, self.cost.tokens_within(self.cost.overhead, start_pos)))
        if self.cost is not None:
            n = min(n, self.cost.tokens_within(self.seconds / max(share, 1), start_pos))
        return max(n, min(floor, most))

    def spend(self, num_tokens: int, start_pos: int, *, prompt: bool) -> None:
        """Counts a placed chunk against every limit."""
        self.tokens -= num_tokens
        if prompt:
            self.prompt_room -= num_tokens
        if self.timed and self.cost is not None:
            self.seconds -= self.cost.chunk_seconds(num_tokens, start_pos)
