"""Which blocks a sequence may give back when every layer attends within a sliding window.

A query at position ``p`` of a layer with window ``W`` reads positions
``max(0, p - W + 1) .. p`` only (``model/attention.py``, ``kernels/attention_f16.c``,
``kernels/fast_forward.c``). Where *every* layer is such a layer (Mistral with its window),
a sequence with ``num_computed`` tokens of K/V never reads a position before
``num_computed - W`` again, as long as it only grows: its next query is at
``num_computed`` at the earliest, or at ``num_computed - 1`` when the last token is
recomputed to sample from it (``Scheduler.add`` after a cancel dropped the last sample),
which reads from ``num_computed - W`` on. The pool gives back the blocks wholly before
``num_computed - W - block_size`` (a registered one stays in the prefix cache as any
released block): one block of slack, so that the cuts that follow generation (a stop
string the consumer found in the last tokens, ``delivered=``, a short rewind) keep the
K/V. A sequence holds at most ``ceil(W / block_size) + 2`` blocks instead of all of them.

What can move a sequence back further is a longer cut: to ``n`` tokens, its next query
may read from ``n - W`` on; if that reaches a dropped block the sequence can no longer
continue from its K/V, and the scheduler releases the table and recomputes the sequence
from its tokens (hitting the prefix cache, where the dropped blocks went, while they are
cached), see :func:`holds_window_after_cut`.

A model with some global layers (Gemma: local layers interleaved with global ones) keeps
every block: its global layers read them all.

This module imports no torch.
"""

from __future__ import annotations


def blocks_outside_window(num_computed: int, window: int, block_size: int) -> int:
    """How many leading blocks a sequence with ``num_computed`` tokens of K/V gives back:
    those wholly before ``num_computed - window - block_size`` (no query reads them again
    while it grows or is cut by at most a block)."""
    return max(0, num_computed - window - block_size) // block_size


def longest_window_hit(cached: list[bool], window: int | None, block_size: int) -> tuple[int, int]:
    """The longest prefix hit over full blocks of which ``cached[i]`` says which are cached:
    (blocks hit, leading blocks of them left dropped).

    Without a window every block of the hit must be cached. With one, a hit of ``k``
    blocks (``k * block_size`` tokens of K/V) needs only the blocks a sequence of that
    length holds (from ``blocks_outside_window`` on): the rest is never read again."""
    if window is None:
        hits = next((i for i, c in enumerate(cached) if not c), len(cached))
        return hits, 0
    best, last_miss = (0, 0), -1
    for k in range(1, len(cached) + 1):
        if not cached[k - 1]:
            last_miss = k - 1
        dropped = blocks_outside_window(k * block_size, window, block_size)
        if last_miss < dropped:
            best = (k, dropped)
    return best


def holds_window_after_cut(num_dropped: int, num_tokens: int, window: int, block_size: int) -> bool:
    """Whether a table that dropped ``num_dropped`` leading blocks, cut to ``num_tokens``
    tokens, still holds every block its next query reads."""
    return num_dropped == 0 or num_dropped * block_size <= num_tokens - window
