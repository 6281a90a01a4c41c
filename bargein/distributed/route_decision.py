"""The router's decision as a pure function: which replica runs a request, given what each
replica holds of its prompt and how busy each is.

Load is counted in time, not in requests: a replica's *queue* is the live requests it would
carry with this one, divided by its speed (1 for the fastest replica; a slow one's measured
share of the fastest's speed, see ``Router.set_speeds``), so each request on a replica half
as fast counts twice. With equal speeds it is the live requests plus one.

Three rules, in order:

1. **A conversation stays.** A replica whose cached prefix of the prompt runs into blocks
   it *generated* (an earlier answer, which the new prompt repeats as its history) holds
   this conversation: the request goes there, unless that replica's queue is
   ``max_imbalance`` longer than the shortest, or it lacks the KV blocks the request needs
   while another has them. Either is a *move*, counted and logged.
2. **A prefix is worth its queue, or nothing.** Otherwise each replica scores
   ``matched_tokens - queue_cost_tokens * (queue - shortest_queue)``: the prompt tokens it
   would not recompute, less its queue beyond the shortest one, each request of it priced
   as ``queue_cost_tokens`` prompt tokens. A shared system prompt (a block or a few) never
   outweighs one request of queue, so chats that share only it spread by load; a long
   shared document (thousands of tokens) outweighs several, so requests about it gather
   where it is cached.
3. **Least loaded otherwise**: the shortest queue (the highest score with no match; ties go
   to the lower index). Concurrent new conversations so spread in proportion to speed.

Plain data in, plain data out: no locks, no Ray, tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """One replica that is up, as the router sees it for this prompt."""

    replica: int
    load: int  # live requests routed there
    matched_blocks: int  # leading full blocks of the prompt it holds (or is computing)
    continues: bool = False  # the match includes blocks it generated: the prompt continues an answer of it
    available_blocks: int | None = None  # KV blocks it can allocate (last report); None: not known yet
    speed: float = 1.0  # its speed as a share of the fastest replica's (0 < speed <= 1)

    @property
    def queue(self) -> float:
        """The live requests it would carry with this one, in the fastest replica's time."""
        return (self.load + 1) / self.speed


@dataclass(frozen=True)
class RoutingWeights:
    """How the decision prices a cached prefix against a queue."""

    block_size: int
    queue_cost_tokens: int = 256  # one live request more than the least loaded replica, in prompt tokens
    max_imbalance: int = 8  # requests of queue more than the shortest: not joined even for a cache

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.queue_cost_tokens < 0 or self.max_imbalance < 1:
            raise ValueError(f"routing weights out of range: {self}")


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why (``reason``: "conversation", "prefix" or "least loaded");
    ``moved_from``: the replica that holds the conversation, when load or memory moved it."""

    replica: int
    reason: str
    moved_from: int | None = None
    why_moved: str = ""


def decide(candidates: Sequence[Candidate], prompt_tokens: int, weights: RoutingWeights,
           reserve_tokens: int = 0) -> Decision:
    """The replica for a prompt of ``prompt_tokens`` tokens that wants ``reserve_tokens``
    more for its answer (the module doc's three rules). ``candidates`` must not be empty."""
    if not candidates:
        raise ValueError("no replica to choose from")
    least = min(candidates, key=lambda c: (c.queue, c.replica))
    homes = [c for c in candidates if c.continues]
    if homes:
        home = max(homes, key=lambda c: (c.matched_blocks, -c.queue, -c.replica))
        if home.queue - least.queue >= weights.max_imbalance:
            return Decision(least.replica, "least loaded", home.replica, f"load {home.load} vs {least.load}")
        return _with_room(home, "conversation", candidates, prompt_tokens, reserve_tokens, weights)

    def score(c: Candidate) -> tuple[float, float, int]:
        excess = c.queue - least.queue
        worth = c.matched_blocks * weights.block_size - weights.queue_cost_tokens * excess
        if excess >= weights.max_imbalance:
            worth = -float(1 << 62)
        return worth, -c.queue, -c.replica

    best = max(candidates, key=score)  # with no match anywhere: the least loaded
    if best.matched_blocks == 0:
        return Decision(best.replica, "least loaded")
    return _with_room(best, "prefix", candidates, prompt_tokens, reserve_tokens, weights)


def _with_room(chosen: Candidate, reason: str, candidates: Sequence[Candidate], prompt_tokens: int,
               reserve_tokens: int, weights: RoutingWeights) -> Decision:
    """``chosen``, unless it lacks the KV blocks this request needs beyond its cached prefix
    while another replica has them (then the roomiest, counted as a move)."""
    bs = weights.block_size
    need = -(-(prompt_tokens - chosen.matched_blocks * bs + reserve_tokens) // bs)
    room = chosen.available_blocks
    if room is not None and room < need:
        roomiest = max(candidates, key=lambda c: (c.available_blocks or 0, -c.load, -c.replica))
        if roomiest.replica != chosen.replica and (roomiest.available_blocks or 0) >= need:
            return Decision(roomiest.replica, reason, chosen.replica,
                            f"memory: {room} KV blocks left there, {need} needed")
    return Decision(chosen.replica, reason)
