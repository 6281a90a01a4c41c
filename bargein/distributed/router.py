"""Which replica runs a request: conversation-affine routing over a per-replica prefix index.

The router is the head's one picture of where K/V lives. For every replica it keeps a
:class:`PrefixIndex`: the keys of the full blocks in that replica's prefix cache, as
the replica reports them (every block registered or evicted, net per key, batched with
each poll's outputs: no Ray call of its own), so the index follows the cache exactly
and never predicts a hit on an evicted block. The keys are the pool's own chained
BLAKE2b hashes, which the router computes from a prompt the same way. Blocks of prompts
dispatched there and not finished yet count as held too (the replica is computing
them). A chat continuation's prompt (the earlier prompt, the answer, the new turn;
token-exact through the prompt memory) starts with the blocks of its previous turn, so
it matches the replica that holds them; that is how continuations stay put without the
router knowing about conversations.

``choose(tokens)`` hands what each replica holds of the prompt and its load to
:func:`~bargein.distributed.route_decision.decide` (the rules are stated there): a
conversation's next turn stays on the replica that generated its last answer (the index
marks blocks a replica registered that no prompt routed there held: answers), a cached
prefix draws a request only where it is worth more than the queue it joins, and the least
loaded replica takes the rest. Load is weighed by each replica's measured speed
(:meth:`Router.set_speeds`, from its node's calibration): a slow replica's requests count
for more, so new conversations go to replicas in proportion to their speed. A conversation *moves* off its replica when that replica
carries ``max_imbalance`` more live requests than the least loaded one, or lacks the KV
blocks the request needs while another has them; moves are counted and logged. A replica
that is down is never chosen; its index is cleared, since its K/V died with it (a
restarted replica reports from empty).

:class:`Tombstones` remembers cancelled ids for a while, so a dispatch that comes after
the cancel (a failover resubmission racing it) is dropped instead of run.

Thread-safe: the event loop routes, pollers record finishes and losses (one lock, held
for O(prompt blocks) at most).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from bargein.distributed.route_decision import Candidate, RoutingWeights, decide
from bargein.distributed.split import speed_factors
from bargein.engine.block_keys import BlockHash, KeyChanges, chain_hash, namespace_root

log = logging.getLogger("bargein.distributed")

POLICIES = ("affine", "round_robin", "least_loaded")


def block_hashes(tokens: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[BlockHash]:
    """The keys a replica's block pool gives the full blocks of ``tokens`` (hash i covers
    tokens [0, (i+1)*block_size)) in the prefix-cache namespace ``cache_salt`` (a tenant's,
    ``SamplingParams.cache_salt``; None the common one): the same chained BLAKE2b from the
    same namespace root, so reported keys compare, and a prompt matches only blocks cached
    in its own namespace."""
    hashes: list[BlockHash] = []
    prev: BlockHash | None = namespace_root(cache_salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = chain_hash(prev, tokens[start:start + block_size])
        hashes.append(prev)
    return hashes


class PrefixIndex:
    """One replica's cached full blocks: the keys it reported (``apply``), plus the blocks
    of prompts dispatched there and not finished yet (``expect``), which it is about to
    compute and which a request sharing them should wait for there rather than recompute
    elsewhere. A held block that no prompt routed there was expected to fill when the
    replica registered it was *generated* there (an answer): a prompt that runs into one
    continues a conversation of this replica."""

    def __init__(self) -> None:
        self._held: set[BlockHash] = set()
        self._expected: Counter[BlockHash] = Counter()
        self._generated: set[BlockHash] = set()

    def __len__(self) -> int:
        return len(self._held)

    @property
    def held(self) -> set[BlockHash]:
        return self._held

    def apply(self, changes: KeyChanges) -> None:
        """The replica's cache changes, in the order it made them (net per key)."""
        if changes.reset:
            self._held.clear()
            self._generated.clear()
        for key, held in changes.keys.items():
            if held:
                self._held.add(key)
                if key not in self._expected:
                    self._generated.add(key)
            else:
                self._held.discard(key)
                self._generated.discard(key)

    def expect(self, hashes: Sequence[BlockHash]) -> None:
        self._expected.update(hashes)

    def unexpect(self, hashes: Sequence[BlockHash]) -> None:
        self._expected.subtract(hashes)
        for h in hashes:
            if self._expected[h] <= 0:
                del self._expected[h]

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks are held or expected, stopping at the first that is not."""
        for i, h in enumerate(hashes):
            if h not in self._held and h not in self._expected:
                return i
        return len(hashes)

    def continues(self, hashes: Sequence[BlockHash], matched: int) -> bool:
        """Whether the first ``matched`` blocks include one this replica generated."""
        return any(h in self._generated for h in hashes[:matched])

    def clear(self) -> None:
        self._held.clear()
        self._expected.clear()
        self._generated.clear()


class Tombstones:
    """Cancelled ids, each remembered for ``ttl_s`` (at most ``capacity`` of them)."""

    def __init__(self, ttl_s: float = 120.0, capacity: int = 65536):
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._at: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        with self._lock:
            self._at[request_id] = time.monotonic()
            self._at.move_to_end(request_id)
            self._expire()

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            self._expire()
            return request_id in self._at

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._at.pop(request_id, None)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._at and (len(self._at) > self.capacity or next(iter(self._at.values())) < cutoff):
            self._at.popitem(last=False)


@dataclass(frozen=True)
class Route:
    """Where a request goes, and why. Hand it back to ``Router.finished`` when the request
    leaves that replica (its expected blocks are then known from the replica's reports)."""

    replica: int
    matched_tokens: int  # prompt tokens the chosen replica is expected to hold
    moved_from: int | None = None  # the replica that held the longer prefix, when load moved it
    hashes: tuple[BlockHash, ...] = ()  # the prompt's full blocks, expected there until it ends


@dataclass
class ReplicaRouting:
    """The router's counts for one replica."""

    up: bool = True
    load: int = 0  # live requests routed here
    routed: int = 0
    prompt_tokens: int = 0
    matched_tokens: int = 0  # predicted prefix hits
    moved_in: int = 0
    moved_out: int = 0
    available_blocks: int | None = None  # KV blocks it can allocate (last report), None: not known yet
    layers_per_s: float | None = None  # its node's calibrated speed (set_speeds); None: not measured
    speed: float = 1.0  # the weight routing gives it: its share of the fastest replica's speed

    @property
    def queue(self) -> float:
        """Its live requests plus one, in the fastest replica's time (route_decision)."""
        return (self.load + 1) / self.speed

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Router:
    """Routes requests to ``num_replicas`` replicas (see the module doc)."""

    num_replicas: int
    block_size: int
    policy: str = "affine"
    max_imbalance: int = 8
    queue_cost_tokens: int = 256  # a live request of queue, priced in cached prompt tokens (route_decision)
    replicas: list[ReplicaRouting] = field(init=False)
    _indexes: list[PrefixIndex] = field(init=False)
    _next: int = 0  # round robin's turn
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self.replicas = [ReplicaRouting() for _ in range(self.num_replicas)]
        self._indexes = [PrefixIndex() for _ in range(self.num_replicas)]
        self._weights = RoutingWeights(self.block_size, self.queue_cost_tokens, self.max_imbalance)

    def choose(self, tokens: Sequence[int], *, cache_salt: str | None = None, exclude: frozenset[int] = frozenset(),
               reserve_tokens: int = 0, count: bool = True) -> Route | None:
        """The replica for a request with these prompt tokens, counted as dispatched there
        (unless ``count`` is False: a conversation handle being placed, not a request).

        ``cache_salt``: the request's prefix-cache namespace (its ``SamplingParams``'): its
        prompt matches only blocks cached under the same namespace, as in the engine, so
        another tenant's cached prompt neither draws it (a timing side channel across
        replicas) nor counts as a hit it will not get. ``reserve_tokens``: room the answer
        will want (its ``max_tokens``), for the memory check. None when no replica is up
        (outside ``exclude``).
        """
        hashes = tuple(block_hashes(tokens, self.block_size, cache_salt))
        with self._lock:
            up = [i for i, r in enumerate(self.replicas) if r.up and i not in exclude]
            if not up:
                return None
            matches = {i: self._indexes[i].match(hashes) for i in up}
            moved_from, why = None, ""
            if self.policy == "round_robin":
                chosen = up[self._next % len(up)]
                self._next += 1
            elif self.policy == "least_loaded":
                chosen = min(up, key=lambda i: (self.replicas[i].queue, i))
            else:
                candidates = [Candidate(i, self.replicas[i].load, matches[i],
                                        self._indexes[i].continues(hashes, matches[i]),
                                        self.replicas[i].available_blocks, self.replicas[i].speed) for i in up]
                decision = decide(candidates, len(tokens), self._weights, reserve_tokens)
                chosen, moved_from, why = decision.replica, decision.moved_from, decision.why_moved
            route = Route(chosen, matches[chosen] * self.block_size, moved_from, hashes if count else ())
            if count:
                self._count(route, len(tokens))
                self._indexes[chosen].expect(hashes)
        if moved_from is not None:
            log.info("a conversation moves from replica %d to replica %d (%s)", moved_from, chosen, why)
        return route

    def set_speeds(self, layers_per_s: Sequence[float | None]) -> None:
        """Each replica's measured speed (its node's calibration: layers per second with
        its threads). Routing weighs a replica by its share of the fastest one's speed, as
        the layer split weighs nodes (:func:`~bargein.distributed.split.speed_factors`: only
        a replica under half as fast as the fastest is weighed down, so measurement noise
        between equal machines changes nothing). A replica not measured (None) leaves every
        weight at 1: speeds that cannot all be compared are not used."""
        if len(layers_per_s) != self.num_replicas:
            raise ValueError(f"{len(layers_per_s)} speeds were given for {self.num_replicas} replicas")
        measured = [r for r in layers_per_s if r is not None and r > 0]
        factors = speed_factors(measured) if len(measured) == self.num_replicas else [1.0] * self.num_replicas
        with self._lock:
            for r, rate, factor in zip(self.replicas, layers_per_s, factors, strict=True):
                r.layers_per_s, r.speed = rate, factor

    def update_memory(self, replica: int, available_blocks: int) -> None:
        """A replica's KV blocks an allocation could take now (free plus evictable), from its last batch."""
        self.replicas[replica].available_blocks = available_blocks

    def _count(self, route: Route, prompt_tokens: int) -> None:
        r = self.replicas[route.replica]
        r.load += 1
        r.routed += 1
        r.prompt_tokens += prompt_tokens
        r.matched_tokens += route.matched_tokens
        if route.moved_from is not None:
            r.moved_in += 1
            self.replicas[route.moved_from].moved_out += 1

    def assign(self, replica: int, num_tokens: int) -> Route:
        """A request that must run on ``replica`` (a conversation handle's turn), counted there."""
        route = Route(replica, 0)
        with self._lock:
            self._count(route, num_tokens)
        return route

    def finished(self, route: Route) -> None:
        """The request routed by ``route`` left its replica (ended, or moved on after a
        loss). What the replica keeps of it, it reports itself (``apply``)."""
        with self._lock:
            r = self.replicas[route.replica]
            r.load = max(0, r.load - 1)
            self._indexes[route.replica].unexpect(route.hashes)

    def apply(self, replica: int, changes: KeyChanges) -> None:
        """A replica's prefix-cache changes (full blocks registered or evicted), as reported
        with its outputs."""
        if not changes:
            return
        with self._lock:
            if self.replicas[replica].up:
                self._indexes[replica].apply(changes)

    def mark_down(self, replica: int) -> None:
        with self._lock:
            self.replicas[replica].up = False
            self.replicas[replica].load = 0
            self._indexes[replica].clear()

    def mark_up(self, replica: int) -> None:
        with self._lock:
            self.replicas[replica].up = True

    def is_up(self, replica: int) -> bool:
        return self.replicas[replica].up

    def held_keys(self, replica: int) -> set[BlockHash]:
        """The keys the index holds as reported by ``replica`` (expected ones left out)."""
        with self._lock:
            return set(self._indexes[replica].held)

    def index_size(self, replica: int) -> int:
        return len(self._indexes[replica])

    def snapshot(self) -> list[dict[str, object]]:
        with self._lock:
            return [{"up": r.up, "load": r.load, "routed": r.routed, "prompt_tokens": r.prompt_tokens,
                     "predicted_hit_tokens": r.matched_tokens, "predicted_hit_rate": round(r.hit_rate, 4),
                     "moved_in": r.moved_in, "moved_out": r.moved_out, "index_blocks": len(self._indexes[i]),
                     "available_blocks": r.available_blocks, "speed": round(r.speed, 4),
                     "layers_per_s": None if r.layers_per_s is None else round(r.layers_per_s, 1)}
                    for i, r in enumerate(self.replicas)]
