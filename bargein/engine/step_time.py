"""Step time, measured: how long a forward takes for the tokens a plan carries.

The scheduler sizes prompt chunks so that a step stays under a time target
(``SchedulerConfig.max_step_ms``); for that it needs to know what a step costs. A
forward's time is modelled as

    seconds = overhead + per_token * tokens + per_pair * attended

where ``tokens`` counts the tokens the step computes and ``attended`` the (query, key)
pairs of their attention (a chunk of n tokens starting at position s attends
n * s + n * (n + 1) / 2 pairs), which is what makes a chunk late in a long prompt cost
more than the same chunk at its start.

The three coefficients are fitted to the steps measured so far by least squares with
exponential forgetting (recent steps weigh more: the machine's load changes), constrained
to be non-negative (each feature subset is solved and the best non-negative fit kept; with
three features that is seven 1-3 unknown solves). Until a step with a prompt chunk has been
measured, and beyond twice the largest step measured, the model does not extrapolate: a
chunk is at most ``PROBE_TOKENS``, or twice the largest measured step's tokens, so the
chunk size grows step by step while measurements come in.

Plain Python, no torch: the scheduler's thread owns one instance and feeds it every step.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass

from bargein.engine.plan import StepPlan

PROBE_TOKENS = 32  # a prompt chunk's size before any prompt chunk was measured
FORGET = 0.97  # each older step weighs this much less than the next one


def attended_pairs(num_tokens: int, start_pos: int) -> int:
    """(query, key) pairs of a chunk of ``num_tokens`` tokens starting at ``start_pos``."""
    return num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2


def plan_features(plan: StepPlan) -> tuple[int, int]:
    """(tokens, attended pairs) of a step's plan: what its time is modelled from."""
    tokens = plan.num_tokens
    pairs = sum(attended_pairs(len(c.query_ids), c.start_pos) for c in plan.chunks)  # guesses too
    return tokens, pairs


@dataclass(frozen=True)
class StepCost:
    """A fitted model: seconds = overhead + per_token * tokens + per_pair * pairs."""

    overhead: float
    per_token: float
    per_pair: float

    def seconds(self, tokens: int, pairs: int) -> float:
        return self.overhead + self.per_token * tokens + self.per_pair * pairs

    def chunk_seconds(self, num_tokens: int, start_pos: int) -> float:
        """The marginal time of one chunk (no overhead: the step pays that once)."""
        return self.per_token * num_tokens + self.per_pair * attended_pairs(num_tokens, start_pos)

    def tokens_within(self, seconds: float, start_pos: int) -> int:
        """The most tokens of a chunk at ``start_pos`` whose marginal time fits ``seconds``."""
        if seconds <= 0:
            return 0
        # per_pair / 2 * n^2 + (per_token + per_pair * (start_pos + 1 / 2)) * n <= seconds
        a = self.per_pair / 2
        b = self.per_token + self.per_pair * (start_pos + 0.5)
        if a == 0:
            return sys.maxsize if b == 0 else int(seconds / b)
        return int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a))


class StepTimer:
    """Measured step times, fitted (see the module doc). One thread uses it."""

    def __init__(self, forget: float = FORGET):
        self.forget = forget
        self._sxx = [[0.0] * 3 for _ in range(3)]  # weighted sums of x x^T, x = (1, tokens, pairs)
        self._sxy = [0.0] * 3  # weighted sums of x * seconds
        self.num_steps = 0
        self.largest_prompt_step = 0  # tokens of the largest measured step with a prompt chunk
        self._cost: StepCost | None = None
        self._skipped_first = False

    def observe(self, tokens: int, pairs: int, seconds: float, *, had_prompt: bool) -> None:
        """Adds one measured step; the very first is left out (it pays one-time set-up costs:
        kernels built and loaded, buffers allocated)."""
        if not self._skipped_first:
            self._skipped_first = True
            return
        x = (1.0, float(tokens), float(pairs))
        for i in range(3):
            self._sxy[i] = self._sxy[i] * self.forget + x[i] * seconds
            for j in range(3):
                self._sxx[i][j] = self._sxx[i][j] * self.forget + x[i] * x[j]
        self.num_steps += 1
        if had_prompt:
            self.largest_prompt_step = max(self.largest_prompt_step, tokens)
        self._cost = None

    def observe_plan(self, plan: StepPlan, seconds: float) -> None:
        tokens, pairs = plan_features(plan)
        self.observe(tokens, pairs, seconds, had_prompt=any(len(c.token_ids) > 1 for c in plan.chunks))

    @property
    def cost(self) -> StepCost | None:
        """The current fit; None before any step was measured."""
        if self._cost is None and self.num_steps:
            self._cost = self._fit()
        return self._cost

    @property
    def explore_limit(self) -> int:
        """The most tokens a prompt chunk may have now: measured ground plus one doubling."""
        return max(PROBE_TOKENS, 2 * self.largest_prompt_step)

    def _fit(self) -> StepCost:
        best: tuple[float, list[float]] | None = None
        for size in (1, 2, 3):
            for subset in itertools.combinations(range(3), size):
                coef = _solve([[self._sxx[i][j] for j in subset] for i in subset], [self._sxy[i] for i in subset])
                if coef is None or any(c < 0 for c in coef):
                    continue
                full = [0.0] * 3
                for k, i in enumerate(subset):
                    full[i] = coef[k]
                # The weighted squared error, up to the constant sum of seconds^2.
                err = -2 * sum(full[i] * self._sxy[i] for i in range(3)) + sum(
                    full[i] * self._sxx[i][j] * full[j] for i in range(3) for j in range(3))
                if best is None or err < best[0]:
                    best = (err, full)
        overhead, per_token, per_pair = best[1] if best is not None else (0.0, 0.0, 0.0)
        return StepCost(overhead, per_token, per_pair)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solves a small symmetric system; None if it is (nearly) singular.

    The features differ by many orders of magnitude (1, tokens, pairs), so the system is
    scaled to a unit diagonal first and singularity is judged on the scaled pivots.
    """
    n = len(b)
    d = [math.sqrt(a[i][i]) for i in range(n)]
    if any(v == 0 for v in d):
        return None
    m = [[a[i][j] / (d[i] * d[j]) for j in range(n)] + [b[i] / d[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-9:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] / d[i] for i in range(n)]
