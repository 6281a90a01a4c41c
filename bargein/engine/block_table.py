"""A sequence's KV blocks (:class:`BlockTable`), what a pool's block holds
(:class:`BlockContent`), and the pool's one refusal (:class:`OutOfBlocks`).

Plain data shared by the block pool (``blocks.py``) and its disk-tier lookups
(``block_disk.py``). This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bargein.engine.block_keys import BlockHash, namespace_root


@dataclass(frozen=True)
class BlockContent:
    """What a cached or registered block holds: its tokens, after the block keyed ``parent``.

    ``key`` is set for a full, registered block; None for a partial one.
    """

    parent: BlockHash | None
    tokens: tuple[int, ...]
    key: BlockHash | None


@dataclass
class BlockTable:
    """A sequence's blocks, in position order, and how many leading ones are registered.

    Block index ``i`` holds positions ``[i * block_size, (i + 1) * block_size)``. The
    first ``num_dropped`` blocks were given back because no query of the sequence can
    read them any more (every layer attends within a sliding window, ``block_window.py``);
    ``block_ids`` holds the blocks from index ``num_dropped`` on, each referenced once by
    this table. ``hashes[i]`` is the chain hash of block i, dropped ones included; only
    the first ``len(hashes)`` blocks are full, computed and registered in the prefix cache
    (or deliberately left out of it because an identical block was registered first), and
    every dropped block is among them. ``root`` is the key block 0 chains from: its
    prefix-cache namespace (``block_keys.namespace_root``); None is the common one.
    """

    block_ids: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    root: BlockHash | None = None
    num_dropped: int = 0

    @classmethod
    def in_namespace(cls, cache_salt: str | None) -> BlockTable:
        """An empty table whose keys chain from ``cache_salt``'s namespace (None: the common one)."""
        return cls(root=namespace_root(cache_salt))

    @property
    def last_key(self) -> BlockHash | None:
        """The key the next full block chains from."""
        return self.hashes[-1] if self.hashes else self.root

    @property
    def num_blocks(self) -> int:
        """Block indices the table spans, dropped ones included (positions / block size, rounded up)."""
        return self.num_dropped + len(self.block_ids)

    def block(self, index: int) -> int:
        """The id of the held block at block ``index`` (not a dropped one)."""
        if index < self.num_dropped:
            raise IndexError(f"block {index} was dropped (outside the sliding window)")
        return self.block_ids[index - self.num_dropped]

    def forward_ids(self) -> tuple[int, ...]:
        """The block id of every block index, for a forward's block table.

        A dropped block stands as the first held one: attention within the window never
        reads a position before it, and the forward writes only the positions it
        computes, which lie in held blocks, so the stand-in is neither read nor written.
        """
        if not self.num_dropped:
            return tuple(self.block_ids)
        return (self.block_ids[0],) * self.num_dropped + tuple(self.block_ids)

    def __len__(self) -> int:
        return self.num_blocks


class OutOfBlocks(Exception):
    """Not enough free or evictable blocks for an allocation; nothing was changed."""
