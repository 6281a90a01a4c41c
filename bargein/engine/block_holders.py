"""Who has held each full block key: what decides whether a closed conversation's blocks
may be deleted from the disk tier.

Each key remembers the block tables that registered or took it (a prefix hit, a fork,
an identical block registered again) in this process's life: the live ones, and
whether any that held it is gone without being closed (a finished one-shot request:
the key is then a *cached prefix* that later requests may hit). Closing a conversation
removes its table from its keys; a key left with no holder at all is *closed*: its file
is deleted from disk and the pool does not write it there again (eviction, shutdown)
unless a new table takes it. A key another live conversation or request holds, or
that a cached prefix shares, stays.

Knowledge starts at each start: a block read back from disk after a restart belongs to
the tables that take it in this run (a restored conversation's close deletes its
blocks; a prefix that a one-shot request shared before the restart is kept only if one
shares it again in this run).

Plain data, no torch; the pool (``blocks.py``) owns one instance and calls it from the
step thread only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

from bargein.engine.block_keys import BlockHash

_PAST = "past"  # a holder that is gone without being closed: a cached prefix
_CLOSED = "closed"


class BlockHolders:
    """Full-block keys -> the tables holding them (weak references), ``_PAST`` if one that
    is gone held it, or ``_CLOSED`` once every holder closed."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, list[weakref.ref | str] | str] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def note(self, key: BlockHash, table: object) -> None:
        """``table`` registered or took the block keyed ``key``."""
        held = self._holders.get(key)
        rest, _ = _without(held if isinstance(held, list) else [], table)
        self._holders[key] = [*rest, weakref.ref(table)]

    def close(self, table: object, keys: Iterable[BlockHash]) -> list[BlockHash]:
        """Removes the closing ``table`` from ``keys``; returns those it held and nothing
        else holds or held (no live table, no cached prefix), now marked closed."""
        closed = []
        for key in keys:
            held = self._holders.get(key)
            if not isinstance(held, list):
                continue
            rest, mine = _without(held, table)
            if not mine:
                continue
            if rest:
                self._holders[key] = rest
            else:
                self._holders[key] = _CLOSED
                closed.append(key)
        return closed

    def is_closed(self, key: BlockHash) -> bool:
        """True for a key whose every holder closed: not to be written to disk."""
        return self._holders.get(key) == _CLOSED

    def prune(self, keep: Callable[[BlockHash], bool]) -> int:
        """Forgets the keys ``keep`` says no one can take any more (in neither memory nor
        disk); returns how many were forgotten."""
        gone = [k for k in self._holders if not keep(k)]
        for k in gone:
            del self._holders[k]
        return len(gone)


def _without(held: list[weakref.ref | str], table: object) -> tuple[list[weakref.ref | str], bool]:
    """``held`` without ``table`` (by identity) and with gone holders folded into one
    ``_PAST``; and whether ``table`` was in it."""
    rest: list[weakref.ref | str] = []
    mine = past = False
    for h in held:
        holder = None if isinstance(h, str) else h()
        if holder is table:
            mine = True
        elif holder is None:
            past = True
        else:
            rest.append(h)
    return ([*rest, _PAST] if past else rest), mine
