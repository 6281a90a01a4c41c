"""The block pool's side of a disk tier below it (``bargein.engine.kv_disk``): plain data
both ways, mixed into :class:`~bargein.engine.blocks.BlockPool`.

With ``track_spills()`` on, every full registered block whose contents the pool drops
(evicted from the cached LRU, or overwritten after a rewind) is reported as a
:class:`~bargein.engine.block_keys.SpillCandidate`, so the caller copies its K/V out before
the block id is written again; ``uncached_full_blocks`` / ``adopt_loaded`` let the caller
look up the full blocks past a memory prefix hit on disk and register those it read back,
as cached blocks that ``match_prefix`` then hits like any other. With spills tracked,
``holders`` also records which table first held each key (``block_holders.py``): a closed
conversation's own blocks are not written to disk again (``holders.close``).

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from bargein.engine.block_holders import BlockHolders
from bargein.engine.block_keys import BlockHash, ChainBlock, SpillCandidate, chain_hash
from bargein.engine.block_table import BlockContent

if TYPE_CHECKING:
    from bargein.engine.blocks import BlockPool


class DiskTierLookups:
    """The disk tier's hooks of :class:`~bargein.engine.blocks.BlockPool` (see the module doc)."""

    spills: list[SpillCandidate] | None
    holders: BlockHolders | None

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

    def uncached_full_blocks(self: BlockPool, token_ids: Sequence[int], max_tokens: int,
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

    def registered_blocks(self: BlockPool) -> list[SpillCandidate]:
        """Every full registered block, referenced or cached, as spill candidates (a
        shutdown writes them all to disk). Changes nothing."""
        return [SpillCandidate(ChainBlock(c.key, c.parent, c.tokens), block)
                for block, c in self._content.items()
                if c.key is not None and not (self.holders is not None and self.holders.is_closed(c.key))]

    def adopt_loaded(self: BlockPool, blocks: Sequence[ChainBlock], reserve: int = 1) -> list[tuple[ChainBlock, int]]:
        """Registers blocks read back from disk as cached blocks, so ``match_prefix`` hits
        them; returns (block, block id) for each one adopted, whose K/V the caller must
        write into that id before the next forward.

        Blocks already registered (a memory prefix, or computed meanwhile) are passed over
        and made most recently used. Blocks are taken while more than ``reserve`` stay
        available, free or by evicting the least recently used cached ones (never one given
        here: each is pinned until the call ends);
        evicted full blocks become spill candidates, which the caller must copy out
        *before* writing the adopted payloads into their ids. Only full blocks whose
        tokens chain to their key (the disk tier checks each file) may be given."""
        if not self.enable_prefix_caching:
            return []
        if any(len(chain_block.tokens) != self.block_size for chain_block in blocks):
            raise ValueError("only full blocks can be adopted")
        # Every block given here, held already or adopted, stays referenced until the end:
        # no take may evict one (an adopted block's payload is not written yet, so its spill
        # would copy stale K/V out under its key; a held one is a parent the rest chain to).
        pinned = {i: block for i, chain_block in enumerate(blocks)
                  if (block := self._hash_to_block.get(chain_block.key)) is not None}
        for block in pinned.values():
            self._ref(block)
        adopted: list[tuple[ChainBlock, int]] = []
        try:
            for i, chain_block in enumerate(blocks):
                if chain_block.key in self._hash_to_block:  # held (pinned above), or given twice
                    continue
                if self.num_available <= reserve:
                    break
                pinned[i] = block = self._take_block()
                self._register(block, BlockContent(chain_block.parent, chain_block.tokens, chain_block.key))
                adopted.append((chain_block, block))
        finally:
            for i in sorted(pinned):  # cached again, in the chain's order at the most recently used end
                self._unref(pinned[i])
        return adopted
