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

Where every layer of the model attends within a sliding window (``window``), a sequence
gives back the blocks no query of it reads again as it grows (``drop_outside_window``,
the rule in ``block_window.py``); its table counts them as dropped.

A disk tier below the pool hooks in through plain data (``block_disk.py``). The table,
the content record and ``OutOfBlocks`` are in ``block_table.py``.

This module holds no tensors and imports no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from bargein.engine.block_disk import DiskTierLookups
from bargein.engine.block_holders import BlockHolders
from bargein.engine.block_keys import BlockHash, ChainBlock, KeyChanges, SpillCandidate, chain_hash
from bargein.engine.block_table import BlockContent, BlockTable, OutOfBlocks
from bargein.engine.block_window import (
    blocks_outside_window,
    holds_window_after_cut,
    longest_context,
    longest_window_hit,
    max_chunk_tokens,
)

__all__ = ["BlockPool", "BlockTable", "OutOfBlocks"]


class BlockPool(DiskTierLookups):
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` token slots each.

    ``window``: the sliding window every layer of the model attends within, so that a
    sequence's blocks before it are given back (``drop_outside_window``); None where
    some layer reads every position (or to keep every block regardless).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 window: int | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if window is not None and window <= 0:
            raise ValueError(f"window must be a positive number of positions; got {window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.dropped_blocks = 0  # blocks given back outside the window, ever (stats and tests)
        self._ref_counts = [0] * num_blocks
        # Free blocks; a list used as a stack, so recently freed (warm) blocks go first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached blocks in eviction order (front = evicted first). An OrderedDict gives
        # O(1) removal from the middle when a prefix hit revives a cached block.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}  # full registered blocks by key
        self._content: dict[int, BlockContent] = {}  # registered (full) and cached partial blocks
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
                assert table.num_dropped <= len(table.hashes), "a table dropped a block it had not registered"
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

    def _register(self, block: int, content: BlockContent) -> None:
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

        Without a window a hit stops at the first block of the chain that is not cached.
        With one (every layer local) it needs only the cached blocks its window reaches
        (``block_window.longest_window_hit``): blocks before them may have been evicted,
        since the chained key of a later block already vouches for every token before it;
        the table counts them as dropped.
        """
        assert not table.block_ids and not table.num_dropped, "match_prefix needs an empty block table"
        if not self.enable_prefix_caching or max_tokens <= 0:
            return 0, []
        parent = table.root
        bs = self.block_size
        keys: list[BlockHash] = []
        found: list[int | None] = []  # each full block's cached id, None where it is not cached
        for i in range(min(max_tokens, len(token_ids)) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            self.prefix_query_blocks += 1
            block = self._hash_to_block.get(h)
            if block is None or self._content[block].tokens != tokens:
                if self.window is None:
                    break
                block = None
            keys.append(h)
            found.append(block)
            parent = h
        hits, dropped = longest_window_hit([b is not None for b in found], self.window, bs)
        for i in range(dropped, hits):
            self._ref(found[i])  # type: ignore[arg-type]
            table.block_ids.append(found[i])  # type: ignore[arg-type]
        table.hashes.extend(keys[:hits])
        table.num_dropped = dropped
        for h in table.hashes if self.holders is not None else ():
            self.holders.note(h, table)  # type: ignore[union-attr]
        self.prefix_hit_blocks += hits
        parent = keys[hits - 1] if hits else table.root
        hit = hits * bs
        partial, copies = self._match_partial(table, parent, token_ids[hit:min(max_tokens, hit + bs)])
        self.drop_outside_window(table, hit + partial)
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
        last = min(table.num_blocks, -(-num_tokens // self.block_size))
        return range(num_computed // self.block_size, last)

    def blocks_needed(self, table: BlockTable, num_computed: int, num_tokens: int) -> int:
        """How many blocks ``ensure_writable`` would take from the pool."""
        needed = max(0, -(-num_tokens // self.block_size) - table.num_blocks)
        shared = self._written_blocks(table, num_computed, num_tokens)
        return needed + sum(self._ref_counts[table.block(i)] > 1 for i in shared)

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
            block = table.block(i)
            if self._ref_counts[block] > 1:
                fresh = self._take_block()
                copies.append((block, fresh))
                self._unref(block)
                table.block_ids[i - table.num_dropped] = fresh
            elif block in self._content:
                # Registered but ours alone (after a rewind): forget its key, then write.
                self._unregister(block)
        if written:
            del table.hashes[written.start:]
        while table.num_blocks * self.block_size < num_tokens:
            table.block_ids.append(self._take_block())
        return copies

    def register_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Registers the table's blocks that are now full and computed under their hashes.

        The one rule for every index of blocks (this prefix cache, a router's index, the
        disk tier): a block is registered only once all its tokens are accepted and
        final, so ``num_computed`` must count only such tokens.
        """
        bs = self.block_size
        while len(table.hashes) < min(num_computed // bs, table.num_blocks):
            i = len(table.hashes)
            parent = table.last_key
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            table.hashes.append(h)
            if self.holders is not None:
                self.holders.note(h, table)
            block = table.block(i)
            if self.enable_prefix_caching and h not in self._hash_to_block and block not in self._content:
                self._register(block, BlockContent(parent, tokens, h))

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
        if (self.enable_prefix_caching and i < table.num_blocks and num_computed > i * bs
                and self._ref_counts[table.block(i)] == 1 and table.block(i) not in self._content):
            end = min(num_computed, (i + 1) * bs, len(token_ids))
            if end > i * bs:
                self._register(table.block(i), BlockContent(table.last_key, tuple(token_ids[i * bs:end]), None))
        for block in reversed(table.block_ids):
            self._unref(block)
        table.block_ids.clear()
        table.hashes.clear()
        table.num_dropped = 0

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block of ``table`` (copy on write later)."""
        for block in table.block_ids:
            self._ref(block)
        forked = BlockTable(list(table.block_ids), list(table.hashes), table.root, table.num_dropped)
        for h in forked.hashes if self.holders is not None else ():
            self.holders.note(h, forked)  # type: ignore[union-attr]
        return forked

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Keeps only the blocks holding the first ``num_tokens`` positions. A cut that
        ``keeps_window`` refuses must release the table instead (ValueError)."""
        if not self.keeps_window(table, num_tokens):
            raise ValueError(f"cutting to {num_tokens} tokens reaches blocks dropped outside the window")
        keep = -(-num_tokens // self.block_size) - table.num_dropped
        for block in reversed(table.block_ids[keep:]):
            self._unref(block)
        del table.block_ids[keep:]
        del table.hashes[num_tokens // self.block_size:]

    # -- sliding windows ---------------------------------------------------------------
    def drop_outside_window(self, table: BlockTable, num_computed: int) -> int:
        """Gives back the table's leading blocks that no query of its sequence (with
        ``num_computed`` tokens of K/V, growing from here) reads again, when every layer
        attends within ``window`` (``block_window.py``); returns how many it gave back.

        Call once the table's full blocks are registered (``register_full_blocks``): a
        dropped block is released as any other, so a registered one stays in the prefix
        cache (cached, evictable) and a later sequence with the same tokens hits it.
        """
        if self.window is None:
            return 0
        drop = min(blocks_outside_window(num_computed, self.window, self.block_size), len(table.hashes),
                   table.num_blocks - 1) - table.num_dropped
        if drop <= 0:
            return 0
        for block in table.block_ids[:drop]:
            self._unref(block)
        del table.block_ids[:drop]
        table.num_dropped += drop
        self.dropped_blocks += drop
        return drop

    def keeps_window(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether ``table`` cut to ``num_tokens`` tokens still holds every block its next
        query reads; if not, the sequence must release it and recompute (a rewind or a
        stop string across the window of a sequence that dropped blocks)."""
        if self.window is None:
            return not table.num_dropped
        return holds_window_after_cut(table.num_dropped, num_tokens, self.window, self.block_size)

    @property
    def max_sequence_tokens(self) -> int | None:
        """The longest sequence this pool holds (``block_window.longest_context``): all its
        slots, or None (no bound) where every layer is local and a window fits beside a
        chunk, since such a sequence gives blocks back as it grows."""
        return longest_context(self.num_blocks, self.block_size, self.window)

    @property
    def max_chunk_tokens(self) -> int | None:
        """The most tokens a prompt chunk may compute where ``max_sequence_tokens`` is None,
        so that one sequence alone always fits (``block_window.max_chunk_tokens``); None
        where no such bound applies (every block of a sequence is kept anyway)."""
        if self.max_sequence_tokens is not None:
            return None
        assert self.window is not None
        return max_chunk_tokens(self.num_blocks, self.window, self.block_size)

