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

So an all-local model's context is not bounded by the pool: a sequence of any length
holds at most its window's blocks and those of the chunk it computes. What bounds it is
the chunk: a prompt chunk of ``n`` tokens needs its own blocks beside the window's, so a
chunk is at most :func:`max_chunk_tokens`, the most that one sequence alone can always
fit; where the pool cannot hold a window and one more token, the context stays bounded by
the pool, as for any model (:func:`longest_context`).

A model with some global layers (Gemma: local layers interleaved with global ones) keeps
every block: its global layers read them all, and its context is bounded by the pool.

This module imports no torch.
"""

from __future__ import annotations

from bargein.config import EngineConfig, ModelConfig


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


def max_chunk_tokens(num_blocks: int, window: int, block_size: int) -> int:
    """The most tokens one chunk of a sequence may compute so that the sequence alone
    always fits a pool of ``num_blocks`` (0 or less: not even one token).

    Computing ``n`` tokens from ``c`` holds blocks ``blocks_outside_window(c) ..
    ceil((c + n) / block_size)``; the most that is, over every ``c``, is ``1 + ceil((window
    + n + block_size - 1) / block_size)`` (``c`` one short of a block past ``window +
    block_size``), which is at most ``num_blocks`` exactly when ``n <= (num_blocks - 2) *
    block_size - window + 1``."""
    return (num_blocks - 2) * block_size - window + 1


def longest_context(num_blocks: int, block_size: int, window: int | None) -> int | None:
    """The longest sequence a pool of ``num_blocks`` blocks can hold: every position's
    block without a window (or with one that some layer ignores: pass None); None (no bound)
    where every layer attends within ``window`` and a sequence's window fits beside a chunk
    of at least one token (:func:`max_chunk_tokens`)."""
    if window is not None and max_chunk_tokens(num_blocks, window, block_size) >= 1:
        return None
    return num_blocks * block_size


def max_positions(config: EngineConfig, model_config: ModelConfig) -> int:
    """The positions a model built for ``config`` must cover (its RoPE tables):
    ``max_model_len`` (else the model's own), bounded by the longest sequence of a pool of
    ``cache.num_blocks`` where the config counts them (none for an all-local model)."""
    positions = config.max_model_len or model_config.max_position_embeddings
    blocks, block_size = config.cache.counted_blocks, config.cache.block_size
    if blocks is None:
        return positions
    return min(positions, longest_context(blocks, block_size, model_config.every_layer_window) or positions)
