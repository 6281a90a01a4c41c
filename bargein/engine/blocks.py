"""The KV block pool: free list, reference counts, prefix hashes and an LRU of cached blocks.

Every block is in exactly one of three states, and the pool can say which at any time:

- *free*: referenced by no sequence and holding nothing reusable;
- *referenced*: in the block table of one or more sequences (``ref_count > 0``);
- *cached*: referenced by nobody but holding K/V of known tokens, so a later sequence
  starting with the same tokens can reuse it instead of recomputing. Cached blocks are
  evicted, least recently released first, only when a free block is needed and none is
  left.

``num_free + num_referenced + num_cached == num_blocks`` always (contract C5).

A full block's key chains its tokens with the previous block's key through a
cryptographic hash (BLAKE2b), and a hit is also checked against the block's tokens, so
one user's K/V can never be served for another's different tokens. A hit on block i
implies the whole prefix up to block i matches. A block is registered under its key
only once it is full and its K/V computed, and it is never written again while
registered: a sequence about to write into a shared or registered block gets a private
copy first (copy on write), which this module reports as a ``(src, dst)`` pair that the
runner must perform before the forward.

Reuse is at token granularity: when a sequence is released, its last, partly filled
block keeps the K/V of its computed tokens as a cached *partial* block, known by its
parent's key and its tokens. A later sequence that matches every full block up to
there and then starts with some of the tokens of a cached block that follows the same
parent (full or partial) gets a copy of that block and reuses those tokens too.

A disk tier below the pool (``bargein.engine.kv_disk``) hooks in at two places, both
plain data: with ``track_spills()`` on, every full registered block whose contents the
pool drops (evicted from the cached LRU, or overwritten after a rewind) is reported as
a :class:`~bargein.engine.block_keys.SpillCandidate`, so the caller copies its K/V out before the block id is
written again; and ``uncached_full_blocks`` / ``adopt_loaded`` let the caller look up the
full blocks past a memory prefix hit on disk and register those it read back, as cached
blocks that ``match_prefix`` then hits like any other. With spills tracked, ``holders``
also records which table first held each key (``block_holders.py``): a closed
conversation's own blocks are not written to disk again (``holders.close``).

This module holds no tensors and imports no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bargein.engine.block_holders import BlockHolders
from bargein.engine.block_keys import (
    BlockHash,
    ChainBlock,
    KeyChanges,
    SpillCandidate,
    chain_hash,
    namespace_root,
)


@dataclass(frozen=True)
class _Content:
    """What a cached or registered block holds: its tokens, after the block keyed ``parent``.

    ``key`` is set for a full, registered block; None for a partial one.
    """

    parent: BlockHash | None
    tokens: tuple[int, ...]
    key: BlockHash | None


@dataclass
class BlockTable:
    """A sequence's blocks, in position order, and how many leading ones are registered.

    ``hashes[i]`` is the chain hash of block i; only the first ``len(hashes)`` blocks
    are full, computed and registered in the prefix cache (or deliberately left out of
    it because an identical block was registered first). ``root`` is the key block 0
    chains from: its prefix-cache namespace (``block_keys.namespace_root``); None is the
    common one.
    """

    block_ids: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    root: BlockHash | None = None

    @classmethod
    def in_namespace(cls, cache_salt: str | None) -> BlockTable:
        """An empty table whose keys chain from ``cache_salt``'s namespace (None: the common one)."""
        return cls(root=namespace_root(cache_salt))

    @property
    def last_key(self) -> BlockHash | None:
        """The key the next full block chains from."""
        return self.hashes[-1] if self.hashes else self.root

    def __len__(self) -> int:
        return len(self.block_ids)


class OutOfBlocks(Exception):
    """Not enough free or evictable blocks for an allocation; nothing was changed."""


class BlockPool:
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # Free blocks; a list used as a stack, so recently freed (warm) blocks go first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached blocks in eviction order (front = evicted first). An OrderedDict gives
        # O(1) removal from the middle when a prefix hit revives a cached block.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}  # full registered blocks by key
        self._content: dict[int, _Content] = {}  # registered (full) and cached partial blocks
        # Blocks with known content, by the key of the block before them: where a
        # token-granular match looks once full-block keys stop matching.
        self._children: dict[BlockHash | None, dict[int, None]] = {}
        self.prefix_hit_blocks = 0  # counters, for stats
        self.prefix_query_blocks = 0
        self.evictions = 0
        # Off unless someone drains it (a replica reporting its cache to the router).
        self.key_changes: KeyChanges | None = None
        # Off unless a disk tier drains it: full blocks whose contents were dropped.
        self.spills: list[SpillCandidate] | None = None
        self.holders: BlockHolders | None = None  # with spills: who held each key (block_holders.py)

    def track_key_changes(self) -> None:
        """Starts recording registered and dropped full-block keys (see ``drain_key_changes``)."""
        self.key_changes = KeyChanges()

    def drain_key_changes(self) -> KeyChanges:
        """The changes since the last drain (tracking must be on)."""
        assert self.key_changes is not None, "track_key_changes() first"
        changes, self.key_changes = self.key_changes, KeyChanges()
        return changes

    def track_spills(self) -> None:
        """Starts reporting full blocks whose contents are dropped (see ``drain_spills``)."""
        self.spills = []
        self.holders = BlockHolders()

    def drain_spills(self) -> list[SpillCandidate]:
        """The blocks dropped since the last drain, oldest first (tracking must be on).

        Drain after each ``schedule`` and after each ``adopt_loaded``, and copy their
        K/V out before anything writes their ids again: the runner's next forward or
        copies, or the adopted payloads. Done in that order on the step thread, each id
        in a drain still holds the K/V of the block it names.
        """
        assert self.spills is not None, "track_spills() first"
        spills, self.spills = self.spills, []
        return spills

    def registered_keys(self) -> set[BlockHash]:
        """The keys of every full block a prefix can hit now (what key changes track)."""
        return set(self._hash_to_block)

    # -- accounting ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return self.num_free + self.num_cached

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_registered(self, block_id: int) -> bool:
        content = self._content.get(block_id)
        return content is not None and content.key is not None

    def check_invariants(self, tables: Iterable[BlockTable] | None = None) -> None:
        """Raises AssertionError unless the accounting is exact.

        With ``tables`` (every live block table), also checks that each block's
        reference count equals the number of tables holding it.
        """
        free, cached = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & cached, "a block is both free and cached"
        for b in range(self.num_blocks):
            refs = self._ref_counts[b]
            assert refs >= 0, f"block {b} has a negative reference count"
            states = (b in free) + (b in cached) + (refs > 0)
            assert states == 1, f"block {b} is in {states} states (refs={refs})"
            if b in cached:
                assert b in self._content, f"cached block {b} has no content"
            if b in free:
                assert b not in self._content, f"free block {b} still has content"
            content = self._content.get(b)
            if content is not None and content.key is None:
                assert refs == 0, f"partial block {b} is cached and referenced"
        for h, b in self._hash_to_block.items():
            assert self._content[b].key == h, f"hash map and block {b} disagree"
        assert self.num_free + self.num_referenced + self.num_cached == self.num_blocks
        if tables is not None:
            counted = [0] * self.num_blocks
            for table in tables:
                for b in table.block_ids:
                    counted[b] += 1
            assert counted == self._ref_counts, "reference counts differ from the block tables"

    def forget_contents(self) -> int:
        """Forgets what every block holds (their K/V was lost, e.g. with a pipeline
        stage): cached blocks become free and no prefix matches any more. Only when no
        block is referenced (the caller dropped every sequence's blocks first).
        Returns the number of cached blocks forgotten."""
        if self.num_referenced:
            raise RuntimeError(f"{self.num_referenced} blocks are still referenced")
        forgotten = len(self._evictable)
        self._free.extend(reversed(self._evictable))  # oldest cached ends on top, as it would be evicted
        self._evictable.clear()
        self._content.clear()
        self._hash_to_block.clear()
        self._children.clear()
        if self.key_changes is not None:
            self.key_changes.reset, self.key_changes.keys = True, {}
        if self.spills is not None:
            self.spills.clear()  # their K/V is lost too: nothing to copy out
        return forgotten

    # -- allocation ---------------------------------------------------------------
    def _take_block(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
            self.evictions += 1
        else:
            raise OutOfBlocks
        self._ref_counts[block] = 1
        return block

    def _register(self, block: int, content: _Content) -> None:
        self._content[block] = content
        if content.key is not None:
            self._hash_to_block[content.key] = block
            if self.key_changes is not None:
                self.key_changes.keys[content.key] = True
        self._children.setdefault(content.parent, {})[block] = None

    def _unregister(self, block: int) -> None:
        """Drops what ``block`` holds (it is about to be written): a full block is
        reported as a spill candidate."""
        content = self._content.pop(block, None)
        if content is None:
            return
        if content.key is not None and self._hash_to_block.get(content.key) == block:
            del self._hash_to_block[content.key]
            if self.key_changes is not None:
                self.key_changes.keys[content.key] = False
            if self.spills is not None and not self.holders.is_closed(content.key):  # type: ignore[union-attr]
                self.spills.append(SpillCandidate(ChainBlock(content.key, content.parent, content.tokens), block))
        siblings = self._children.get(content.parent)
        if siblings is not None:
            siblings.pop(block, None)
            if not siblings:
                del self._children[content.parent]

    def _ref(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            self._evictable.pop(block)
        self._ref_counts[block] += 1

    def _unref(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self._content:
                self._evictable[block] = None  # most recently used end
            else:
                self._free.append(block)

    # -- sequence operations -----------------------------------------------------
    def match_prefix(self, table: BlockTable, token_ids: Sequence[int],
                     max_tokens: int) -> tuple[int, list[tuple[int, int]]]:
        """Fills an empty table with cached K/V for the leading tokens of ``token_ids``, at
        most ``max_tokens`` of them; returns (tokens reused, block copies to make).

        Full blocks are shared by key (checked against their tokens). Then, at token
        granularity, the cached block after the last full hit that shares the most leading
        tokens with the rest is copied into a fresh block (copy on write).
        """
        assert not table.block_ids, "match_prefix needs an empty block table"
        if not self.enable_prefix_caching or max_tokens <= 0:
            return 0, []
        parent = table.root
        bs = self.block_size
        for i in range(min(max_tokens, len(token_ids)) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            self.prefix_query_blocks += 1
            block = self._hash_to_block.get(h)
            if block is None or self._content[block].tokens != tokens:
                break
            self._ref(block)
            table.block_ids.append(block)
            table.hashes.append(h)
            if self.holders is not None:
                self.holders.note(h, table)
            self.prefix_hit_blocks += 1
            parent = h
        hit = len(table.block_ids) * bs
        partial, copies = self._match_partial(table, parent, token_ids[hit:min(max_tokens, hit + bs)])
        return hit + partial, copies

    def _match_partial(self, table: BlockTable, parent: BlockHash | None,
                       rest: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
        """Copies the cached block after ``parent`` sharing the longest head with ``rest``;
        returns (tokens reused, copies)."""
        best, best_len = None, 0
        for block in self._children.get(parent, ()):
            tokens = self._content[block].tokens
            n = 0
            for a, b in zip(tokens, rest, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block, n
        if best is None or self.num_available < 2:
            return 0, []
        self._ref(best)  # so taking the copy's block cannot evict the source
        fresh = self._take_block()
        self._unref(best)
        table.block_ids.append(fresh)
        return best_len, [(best, fresh)]

    def _written_blocks(self, table: BlockTable, num_computed: int, num_tokens: int) -> range:
        """Indices of the table's existing blocks that positions [num_computed, num_tokens) touch."""
        if num_computed >= num_tokens:
            return range(0)
        last = min(len(table.block_ids), -(-num_tokens // self.block_size))
        return range(num_computed // self.block_size, last)

    def blocks_needed(self, table: BlockTable, num_computed: int, num_tokens: int) -> int:
        """How many blocks ``ensure_writable`` would take from the pool."""
        needed = max(0, -(-num_tokens // self.block_size) - len(table.block_ids))
        shared = self._written_blocks(table, num_computed, num_tokens)
        return needed + sum(self._ref_counts[table.block_ids[i]] > 1 for i in shared)

    def ensure_writable(self, table: BlockTable, num_computed: int, num_tokens: int) -> list[tuple[int, int]]:
        """Makes positions ``[num_computed, num_tokens)`` writable by this table alone.

        Appends blocks as needed and replaces a shared block about to be written with a
        private copy. Returns the ``(src, dst)`` copies the runner must make before the
        forward. Raises OutOfBlocks, changing nothing, if the pool cannot supply them.
        """
        if self.blocks_needed(table, num_computed, num_tokens) > self.num_available:
            raise OutOfBlocks
        copies: list[tuple[int, int]] = []
        written = self._written_blocks(table, num_computed, num_tokens)
        for i in written:
            block = table.block_ids[i]
            if self._ref_counts[block] > 1:
                fresh = self._take_block()
                copies.append((block, fresh))
                self._unref(block)
                table.block_ids[i] = fresh
            elif block in self._content:
                # Registered but ours alone (after a rewind): forget its key, then write.
                self._unregister(block)
        if written:
            del table.hashes[written.start:]
        while len(table.block_ids) * self.block_size < num_tokens:
            table.block_ids.append(self._take_block())
        return copies

    def register_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Registers the table's blocks that are now full and computed under their hashes.

        The one rule for every index of blocks (this prefix cache, a router's index, the
        disk tier): a block is registered only once all its tokens are accepted and
        final, so ``num_computed`` must count only such tokens.
        """
        bs = self.block_size
        while len(table.hashes) < min(num_computed // bs, len(table.block_ids)):
            i = len(table.hashes)
            parent = table.last_key
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            table.hashes.append(h)
            if self.holders is not None:
                self.holders.note(h, table)
            block = table.block_ids[i]
            if self.enable_prefix_caching and h not in self._hash_to_block and block not in self._content:
                self._register(block, _Content(parent, tokens, h))

    def release(self, table: BlockTable, token_ids: Sequence[int] = (), num_computed: int = 0) -> None:
        """Drops the table's references; registered blocks become cached, others free.

        With the sequence's ``token_ids`` and ``num_computed``, its partly filled block
        after the registered ones keeps its computed tokens' K/V as a cached partial
        block (when nobody else holds it), for token-granular reuse.

        Blocks are released tail first, so that a sequence's last blocks are evicted
        before its first ones (a shorter shared prefix is the likelier hit).
        """
        i = len(table.hashes)
        bs = self.block_size
        if (self.enable_prefix_caching and i < len(table.block_ids) and num_computed > i * bs
                and self._ref_counts[table.block_ids[i]] == 1 and table.block_ids[i] not in self._content):
            end = min(num_computed, (i + 1) * bs, len(token_ids))
            if end > i * bs:
                self._register(table.block_ids[i], _Content(table.last_key, tuple(token_ids[i * bs:end]), None))
        for block in reversed(table.block_ids):
            self._unref(block)
        table.block_ids.clear()
        table.hashes.clear()

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block of ``table`` (copy on write later)."""
        for block in table.block_ids:
            self._ref(block)
        forked = BlockTable(list(table.block_ids), list(table.hashes), table.root)
        for h in forked.hashes if self.holders is not None else ():
            self.holders.note(h, forked)  # type: ignore[union-attr]
        return forked

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Keeps only the blocks holding the first ``num_tokens`` positions."""
        keep = -(-num_tokens // self.block_size)
        for block in reversed(table.block_ids[keep:]):
            self._unref(block)
        del table.block_ids[keep:]
        del table.hashes[num_tokens // self.block_size:]

    # -- the disk tier's lookups ---------------------------------------------------
    def uncached_full_blocks(self, token_ids: Sequence[int], max_tokens: int,
                             root: BlockHash | None = None) -> list[ChainBlock]:
        """The full blocks of ``token_ids`` (within its first ``max_tokens``, chained from
        ``root``: its namespace) after the longest prefix of full blocks registered here,
        with their chained keys: what a disk tier may hold. Changes nothing and counts nothing."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        parent = root
        wanted: list[ChainBlock] = []
        for i in range(min(max_tokens, len(token_ids)) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block = None if wanted else self._hash_to_block.get(h)  # once one misses, all after do
            if block is None or self._content[block].tokens != tokens:
                wanted.append(ChainBlock(h, parent, tokens))
            parent = h
        return wanted

    def registered_blocks(self) -> list[SpillCandidate]:
        """Every full registered block, referenced or cached, as spill candidates (a
        shutdown writes them all to disk). Changes nothing."""
        return [SpillCandidate(ChainBlock(c.key, c.parent, c.tokens), block)
                for block, c in self._content.items()
                if c.key is not None and not (self.holders is not None and self.holders.is_closed(c.key))]

    def adopt_loaded(self, blocks: Sequence[ChainBlock], reserve: int = 1) -> list[tuple[ChainBlock, int]]:
        """Registers blocks read back from disk as cached blocks, so ``match_prefix`` hits
        them; returns (block, block id) for each one adopted, whose K/V the caller must
        write into that id before the next forward.

        Blocks already registered (a memory prefix, or computed meanwhile) are passed over
        and made most recently used. At most ``num_available - reserve`` blocks are taken,
        free or by evicting the least recently used cached ones (never one given here);
        evicted full blocks become spill candidates, which the caller must copy out
        *before* writing the adopted payloads into their ids. Only full blocks whose
        tokens chain to their key (the disk tier checks each file) may be given."""
        if not self.enable_prefix_caching:
            return []
        budget = self.num_available - reserve
        adopted: list[tuple[ChainBlock, int]] = []
        for chain_block in blocks:
            if len(chain_block.tokens) != self.block_size:
                raise ValueError("only full blocks can be adopted")
            if (held := self._hash_to_block.get(chain_block.key)) is not None:
                if held in self._evictable:  # so that adopting the rest does not evict it
                    self._evictable.move_to_end(held)
                continue
            if len(adopted) >= budget:
                break
            block = self._take_block()
            self._register(block, _Content(chain_block.parent, chain_block.tokens, chain_block.key))
            self._unref(block)  # cached: at the most recently used end
            adopted.append((chain_block, block))
        return adopted
