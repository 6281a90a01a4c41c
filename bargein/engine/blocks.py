"""The KV block pool: free list, reference counts, prefix hashes and an LRU of cached blocks.

Every block is in exactly one of three states, and the pool can say which at any time:

- *free*: referenced by no sequence and holding nothing reusable;
- *referenced*: in the block table of one or more sequences (``ref_count > 0``);
- *cached*: referenced by nobody but full of K/V that a prefix hash still names, so a
  later sequence starting with the same tokens can take it back instead of recomputing.
  Cached blocks are evicted, least recently released first, only when a free block is
  needed and none is left.

``num_free + num_referenced + num_cached == num_blocks`` always (contract C5).

A full block's hash chains its tokens with the previous block's hash, so a hit on block
i implies the whole prefix up to block i matches. A block is registered under its hash
only once it is full and its K/V computed, and it is never written again while
registered: a sequence about to write into a shared or registered block gets a private
copy first (copy on write), which this module reports as a ``(src, dst)`` pair that the
runner must perform before the forward.

This module holds no tensors and imports no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

BlockHash = int


def chain_hash(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """The hash naming a full block of ``tokens`` that follows a block hashed ``parent``."""
    return hash((parent, tuple(tokens)))


@dataclass
class BlockTable:
    """A sequence's blocks, in position order, and how many leading ones are registered.

    ``hashes[i]`` is the chain hash of block i; only the first ``len(hashes)`` blocks
    are full, computed and registered in the prefix cache (or deliberately left out of
    it because an identical block was registered first).
    """

    block_ids: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)

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
        self._hash_to_block: dict[BlockHash, int] = {}
        self._block_hash: dict[int, BlockHash] = {}
        self.prefix_hit_blocks = 0  # counters, for stats
        self.prefix_query_blocks = 0
        self.evictions = 0

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
        return block_id in self._block_hash

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
                assert b in self._block_hash, f"cached block {b} has no hash"
            if b in free:
                assert b not in self._block_hash, f"free block {b} still has a hash"
        for h, b in self._hash_to_block.items():
            assert self._block_hash.get(b) == h, f"hash map and block {b} disagree"
        assert self.num_free + self.num_referenced + self.num_cached == self.num_blocks
        if tables is not None:
            counted = [0] * self.num_blocks
            for table in tables:
                for b in table.block_ids:
                    counted[b] += 1
            assert counted == self._ref_counts, "reference counts differ from the block tables"

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

    def _unregister(self, block: int) -> None:
        h = self._block_hash.pop(block, None)
        if h is not None and self._hash_to_block.get(h) == block:
            del self._hash_to_block[h]

    def _ref(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            self._evictable.pop(block)
        self._ref_counts[block] += 1

    def _unref(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self._block_hash:
                self._evictable[block] = None  # most recently used end
            else:
                self._free.append(block)

    # -- sequence operations -----------------------------------------------------
    def match_prefix(self, table: BlockTable, token_ids: Sequence[int], max_blocks: int) -> int:
        """Fills an empty table with cached blocks matching the leading full blocks of
        ``token_ids``, at most ``max_blocks`` of them; returns how many matched."""
        assert not table.block_ids, "match_prefix needs an empty block table"
        if not self.enable_prefix_caching:
            return 0
        parent: BlockHash | None = None
        bs = self.block_size
        for i in range(min(max_blocks, len(token_ids) // bs)):
            h = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            self.prefix_query_blocks += 1
            block = self._hash_to_block.get(h)
            if block is None:
                break
            self._ref(block)
            table.block_ids.append(block)
            table.hashes.append(h)
            self.prefix_hit_blocks += 1
            parent = h
        return len(table.block_ids)

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
            elif block in self._block_hash:
                # Registered but ours alone (after a rewind): forget its hash, then write.
                self._unregister(block)
        if written:
            del table.hashes[written.start:]
        while len(table.block_ids) * self.block_size < num_tokens:
            table.block_ids.append(self._take_block())
        return copies

    def register_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Registers the table's blocks that are now full and computed under their hashes."""
        bs = self.block_size
        while len(table.hashes) < min(num_computed // bs, len(table.block_ids)):
            i = len(table.hashes)
            parent = table.hashes[-1] if table.hashes else None
            h = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            table.hashes.append(h)
            block = table.block_ids[i]
            if self.enable_prefix_caching and h not in self._hash_to_block and block not in self._block_hash:
                self._hash_to_block[h] = block
                self._block_hash[block] = h

    def release(self, table: BlockTable) -> None:
        """Drops the table's references; registered blocks become cached, others free.

        Blocks are released tail first, so that a sequence's last blocks are evicted
        before its first ones (a shorter shared prefix is the likelier hit).
        """
        for block in reversed(table.block_ids):
            self._unref(block)
        table.block_ids.clear()
        table.hashes.clear()

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block of ``table`` (copy on write later)."""
        for block in table.block_ids:
            self._ref(block)
        return BlockTable(list(table.block_ids), list(table.hashes))

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Keeps only the blocks holding the first ``num_tokens`` positions."""
        keep = -(-num_tokens // self.block_size)
        for block in reversed(table.block_ids[keep:]):
            self._unref(block)
        del table.block_ids[keep:]
        del table.hashes[num_tokens // self.block_size:]
