"""Which replica runs a request: conversation-affine routing over a per-replica prefix index.

The router is the head's one picture of where K/V lives. For every replica it keeps a
:class:`PrefixIndex`: the chained hashes of the full blocks of every sequence sent
there (at dispatch: the prompt; at the end: prompt plus the answer the client got),
least recently used first, capped at the replica's number of KV blocks so it forgets
roughly when the replica's prefix cache does. A chat continuation's prompt (the earlier
prompt, the answer, the new turn; token-exact through the prompt memory) starts with
the blocks of its previous turn, so it matches the replica that holds them; that is how
continuations stay put without the router knowing about conversations.

``choose(tokens)`` picks the replica with the longest matched prefix; with no match, the
least loaded (live requests). A conversation *moves* off its replica when that replica
carries ``max_imbalance`` more live requests than the least loaded one (its cache is then
worth less than the queue), or when it has fewer KV blocks to allocate (free plus
evictable, as its last batch reported) than the request needs beyond its cached prefix
(prompt and ``max_tokens``) while another has them; moves are counted and logged. A replica that is down
is never chosen; its index is cleared, since its K/V died with it.

:class:`Tombstones` remembers cancelled ids for a while, so a dispatch that comes after
the cancel (a failover resubmission racing it) is dropped instead of run.

Thread-safe: the event loop routes, pollers record finishes and losses (one lock, held
for O(prompt blocks) at most).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("bargein.distributed")

POLICIES = ("affine", "round_robin", "least_loaded")


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``: hash i covers tokens [0, (i+1)*block_size)."""
    hashes, prev = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = hash((prev, tuple(tokens[start:start + block_size])))
        hashes.append(prev)
    return hashes


class PrefixIndex:
    """One replica's cached prefixes as block hashes, least recently used first, bounded."""

    def __init__(self, capacity_blocks: int):
        self.capacity = max(1, capacity_blocks)
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def insert(self, hashes: Sequence[int]) -> None:
        """Records a sequence's blocks as just used; its last block is forgotten first (a
        prefix's later blocks are worth nothing without its earlier ones)."""
        for h in reversed(hashes):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks are held, stopping at the first that is not."""
        for i, h in enumerate(hashes):
            if h not in self._hashes:
                return i
        return len(hashes)

    def clear(self) -> None:
        self._hashes.clear()


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
    """Where a request goes, and why."""

    replica: int
    matched_tokens: int  # prompt tokens the chosen replica is expected to hold
    moved_from: int | None = None  # the replica that held the longer prefix, when load moved it


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

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Router:
    """Routes requests to ``num_replicas`` replicas (see the module doc)."""

    num_replicas: int
    block_size: int
    capacity_blocks: int
    policy: str = "affine"
    max_imbalance: int = 8
    replicas: list[ReplicaRouting] = field(init=False)
    _indexes: list[PrefixIndex] = field(init=False)
    _next: int = 0  # round robin's turn
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self.replicas = [ReplicaRouting() for _ in range(self.num_replicas)]
        self._indexes = [PrefixIndex(self.capacity_blocks) for _ in range(self.num_replicas)]

    def choose(self, tokens: Sequence[int], *, exclude: frozenset[int] = frozenset(),
               reserve_tokens: int = 0) -> Route | None:
        """The replica for a request with these prompt tokens, counted as dispatched there.

        ``reserve_tokens``: room the answer will want (its ``max_tokens``), for the memory
        check. None when no replica is up (outside ``exclude``).
        """
        hashes = block_hashes(tokens, self.block_size)
        with self._lock:
            up = [i for i, r in enumerate(self.replicas) if r.up and i not in exclude]
            if not up:
                return None
            least = min(up, key=lambda i: (self.replicas[i].load, i))
            matches = {i: self._indexes[i].match(hashes) for i in up}
            moved_from, why = None, ""
            if self.policy == "round_robin":
                chosen = up[self._next % len(up)]
                self._next += 1
            elif self.policy == "least_loaded":
                chosen = least
            else:
                best = max(up, key=lambda i: (matches[i], -self.replicas[i].load, -i))
                chosen = best if matches[best] else least
                if matches[best]:
                    moved_from, chosen, why = self._move(best, least, up, len(tokens), matches, reserve_tokens)
            route = Route(chosen, matches[chosen] * self.block_size, moved_from)
            self._count(route, len(tokens))
            self._indexes[chosen].insert(hashes)
        if moved_from is not None:
            log.info("a conversation moves from replica %d to replica %d (%s)", moved_from, chosen, why)
        return route

    def _move(self, best: int, least: int, up: list[int], num_tokens: int, matches: dict[int, int],
              reserve_tokens: int) -> tuple[int | None, int, str]:
        """Whether a request leaves the replica that holds its prefix: (moved_from, chosen, why)."""
        r = self.replicas
        if r[best].load - r[least].load >= self.max_imbalance:
            return best, least, f"load {r[best].load} vs {r[least].load}"
        need = -(-(num_tokens - matches[best] * self.block_size + reserve_tokens) // self.block_size)
        room = r[best].available_blocks
        if room is not None and room < need:
            roomiest = max(up, key=lambda i: (r[i].available_blocks or 0, -r[i].load))
            if roomiest != best and (r[roomiest].available_blocks or 0) >= need:
                return best, roomiest, f"memory: {room} KV blocks left there, {need} needed"
        return None, best, ""

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

    def finished(self, replica: int, tokens: Sequence[int]) -> None:
        """A request ended there; its replica keeps these tokens' K/V (prompt and delivered answer)."""
        hashes = block_hashes(tokens, self.block_size)
        with self._lock:
            r = self.replicas[replica]
            r.load = max(0, r.load - 1)
            if r.up:
                self._indexes[replica].insert(hashes)

    def released(self, replica: int) -> None:
        """A request left the replica without its K/V being worth remembering (it was lost or moved)."""
        with self._lock:
            r = self.replicas[replica]
            r.load = max(0, r.load - 1)

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

    def index_size(self, replica: int) -> int:
        return len(self._indexes[replica])

    def snapshot(self) -> list[dict[str, object]]:
        with self._lock:
            return [{"up": r.up, "load": r.load, "routed": r.routed, "prompt_tokens": r.prompt_tokens,
                     "predicted_hit_tokens": r.matched_tokens, "predicted_hit_rate": round(r.hit_rate, 4),
                     "moved_in": r.moved_in, "moved_out": r.moved_out, "index_blocks": len(self._indexes[i]),
                     "available_blocks": r.available_blocks}
                    for i, r in enumerate(self.replicas)]
