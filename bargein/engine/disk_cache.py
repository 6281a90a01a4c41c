"""The disk tier wired to one engine: its block pool, its scheduler's queue and the
runner's K/V caches (``bargein.engine.kv_disk`` holds the tier itself).

Everything here runs on the engine's thread, between steps, when no plan is in flight
(the in-process runner holds one plan and collects it within the step), so the caches
it reads and writes are the runner's and nobody else's at that moment:

- ``before_schedule``: blocks read back since the last step are adopted by the pool
  (``BlockPool.adopt_loaded``), the blocks that evicts are copied out first, then the
  payloads are written into their new ids and their requests are let go; then every
  newly waiting request without blocks is looked up on disk (the full blocks past its
  memory prefix hit, by chained key) and, if the tier holds the next ones, held in the
  queue (``Scheduler.held``) while the reader thread loads them. Other requests are
  admitted meanwhile: no step waits for a disk read.
- ``after_schedule``: the blocks the schedule evicted (``BlockPool.drain_spills``) are
  copied out of the caches (one gather per cache tensor) and queued for the writer
  thread, before the runner's next forward or copy writes their ids. Only the copy is
  on the step path; hashing and the file write are not.
- ``forget_closed``: a closed conversation's full blocks that only it ever held are
  deleted from disk (queued after any write of them) and not written again; blocks a
  cached prefix or another sequence shares stay (``block_holders.py`` says which).
- ``close``: at shutdown every full registered block (conversations' and cached
  prefixes') is written, within a time limit, then the tier is closed.

The tier's K/V store is a ``kv_disk.kv_tier.KVTier``: with the in-process runner, one
``LocalKVTier`` over its caches; with a runner that holds the K/V elsewhere (a pipeline,
a ``KVTierHost``), what that runner opens: its stages' own tiers, one per layer range
(``stage_tier_directory``, ``stage_fingerprint``), driven through its plans.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from bargein.config import CacheConfig
from bargein.engine.block_keys import BlockHash, ChainBlock, SpillCandidate, chain_hash
from bargein.engine.blocks import BlockPool, BlockTable
from bargein.engine.kv_disk.fingerprint import ModelFingerprint, identity_files, sources_digest
from bargein.engine.kv_disk.kv_tier import KVTier, KVTierHost
from bargein.engine.kv_disk.stats import DiskTierStats
from bargein.engine.request import Sequence as TokenSequence
from bargein.engine.runner import ModelRunner, Runner
from bargein.engine.scheduler import Scheduler

log = logging.getLogger("bargein.engine")

_SHUTDOWN_BATCH = 64  # blocks copied out at once at shutdown (bounds the host memory it takes)


def kernels_digest() -> str:
    """A digest of the native kernels' sources: a change to them gives new fingerprints."""
    import bargein.kernels

    folder = Path(bargein.kernels.__file__).parent
    return sources_digest(sorted(folder.glob("*.c")) + sorted(folder.glob("*.h")))


def stage_tier_directory(base: str | os.PathLike[str], layer_range: tuple[int, int]) -> Path:
    """Where a pipeline stage holding layers ``[start, end)`` keeps its own tier:
    ``base/stage-<start>-<end>`` (its fingerprint names the same range, so a stage never
    reads another range's K/V even if directories are mixed up)."""
    start, end = layer_range
    return Path(base) / f"stage-{start}-{end}"


def stage_fingerprint(stages: Sequence, block_size: int, model_identity: str | os.PathLike[str], *,
                      files: tuple[tuple[str, int, str], ...] | None = None) -> ModelFingerprint:
    """The fingerprint of K/V computed by ``stages`` (consecutive LlamaStages) over the
    model ``model_identity``: its file or folder, or a string naming in-memory weights
    (or ``files``, its files' identities as another process computed them)."""
    first = stages[0]
    files = identity_files(model_identity) if files is None else files
    precision = f"{'fast' if first.kernels.fast else 'exact'}/{first.dtype}/{first.device.type}"
    return ModelFingerprint(files, precision, str(first.kv_dtype), block_size, (stages[0].start, stages[-1].end),
                            kernels=kernels_digest())


class DiskCache:
    """One engine's use of a :class:`DiskTier` (see the module docstring)."""

    def __init__(self, tier: KVTier, pool: BlockPool, scheduler: Scheduler, ready: threading.Event):
        """``ready`` is set by the tier's ``on_loaded`` (a load finished)."""
        self.tier, self.pool, self.scheduler = tier, pool, scheduler
        self._ready = ready
        self._looked_up: set[str] = set()  # requests already looked up on disk
        self.loaded_blocks = 0  # blocks adopted from disk, ever
        pool.track_spills()

    @classmethod
    def open(cls, cache: CacheConfig, runner: Runner, pool: BlockPool, scheduler: Scheduler,
             model_identity: str | os.PathLike[str] | None) -> DiskCache | None:
        """The engine's disk cache per ``cache.kv_disk_dir``; None (after one warning) when
        it cannot be used: a runner that neither runs in this process nor opens a tier of
        its own, no model identity, prefix caching off, or the directory owned by another
        server."""
        reason = ("the disk tier needs the in-process runner or a pipeline"
                  if not isinstance(runner, ModelRunner | KVTierHost) else
                  "the disk tier needs the model's file or an identity for its weights" if model_identity is None
                  else "prefix caching is off" if not cache.enable_prefix_caching else None)
        if reason is not None:
            log.warning("%s: running without it", reason)
            return None
        assert model_identity is not None and cache.kv_disk_dir is not None
        ready = threading.Event()
        tier: KVTier | None
        if isinstance(runner, ModelRunner):
            # imported here: the tier's modules are 6-8 ms of a start without a disk tier
            from bargein.engine.kv_disk.local_tier import LocalKVTier

            fingerprint = stage_fingerprint(runner.stages, cache.block_size, model_identity)
            pairs = [(c.k, c.v) for stage_caches in runner.kv_caches for c in stage_caches]
            tier = LocalKVTier.open(cache.kv_disk_dir, fingerprint, cache.kv_disk_bytes, caches=pairs,
                                    on_loaded=ready.set)
        else:
            assert isinstance(runner, KVTierHost)
            tier = runner.open_kv_tier(cache, model_identity, ready.set)
        if tier is None:
            return None
        report = tier.rebuild
        log.info("kv disk: %d blocks (%.1f MiB) in %s, indexed in %.0f ms", report.blocks, report.bytes / 2**20,
                 cache.kv_disk_dir, report.seconds * 1000)
        return cls(tier, pool, scheduler, ready)

    # -- each step ----------------------------------------------------------------------
    def before_schedule(self) -> None:
        """Adopts what was read, then looks up newly waiting requests (see the module doc)."""
        self._adopt_loaded()
        self._look_up_waiting()
        scheduler = self.scheduler
        if (scheduler.held and scheduler.waiting and not scheduler.running
                and all(r.request_id in scheduler.held for r in scheduler.waiting)):
            self._ready.wait(0.05)  # only reads to wait for: not a busy loop
            self._adopt_loaded()

    def after_schedule(self) -> None:
        """Copies the blocks the schedule evicted out of the caches and queues them."""
        self._spill(self.pool.drain_spills())
        holders = self.pool.holders
        if holders is not None and len(holders) > 4 * (self.pool.num_blocks + self.tier.num_blocks) + 1024:
            registered = self.pool.registered_keys()
            holders.prune(lambda k: k in registered or k in self.tier)

    def forget_closed(self, table: BlockTable, token_ids: Sequence[int],
                      others: Iterable[tuple[Sequence[int], BlockHash | None]]) -> list[BlockHash]:
        """Deletes from disk the full blocks of a closing conversation (``table``, holding
        ``token_ids``) that only it held and that none of the ``others`` (every other live
        sequence's tokens and namespace root) contains; returns their keys. Call before the
        pool releases it."""
        holders = self.pool.holders
        bs = self.pool.block_size
        own = [] if holders is None else holders.close(table, chain_keys(token_ids, bs, table.root))
        if own:
            live: set[BlockHash] = set()
            for tokens, root in others:
                live.update(chain_keys(tokens, bs, root))
            own = [k for k in own if k not in live]
            self.tier.delete(own)
        return own

    def _spill(self, candidates: Sequence[SpillCandidate], timeout: float = 0.0) -> int:
        return self.tier.spill_blocks(candidates, timeout)

    def _look_up_waiting(self) -> None:
        scheduler = self.scheduler
        for req in scheduler.waiting:
            rid = req.request_id
            if rid in self._looked_up:
                continue
            self._looked_up.add(rid)
            seq = req.sequence
            if seq.block_table.block_ids:
                continue
            # As the scheduler's match: the last token is always computed (its logits are sampled).
            wanted = self.pool.uncached_full_blocks(seq.token_ids, seq.num_tokens - 1, seq.block_table.root)
            n = self.tier.present([w.key for w in wanted])
            if n:
                scheduler.held.add(rid)
                self.tier.load(rid, wanted[:n])
        if len(self._looked_up) > 4 * len(scheduler.requests) + 64:
            self._looked_up &= set(scheduler.requests)

    def _adopt_loaded(self) -> None:
        self._ready.clear()
        for done in self.tier.drain_loaded():
            self.scheduler.held.discard(done.ticket)
            req = self.scheduler.requests.get(done.ticket)
            if req is None or not done.records:
                self.tier.install(done, ())  # nothing to place: the load is forgotten
                continue
            # The request's memory prefix goes first, so adopting what was read after it never evicts it.
            loaded = [ChainBlock(r.key, r.parent, r.tokens) for r in done.records]
            adopted = self.pool.adopt_loaded(self._memory_prefix(req.sequence) + loaded)
            self._spill(self.pool.drain_spills())  # what adopting evicted, before its ids are written
            self.tier.install(done, [(block.key, block_id) for block, block_id in adopted])
            self.loaded_blocks += len(adopted)

    def _memory_prefix(self, seq: TokenSequence) -> list[ChainBlock]:
        """The sequence's leading full blocks registered in the pool now (as the scheduler's
        match counts them: the last token is always computed)."""
        limit, bs = seq.num_tokens - 1, self.pool.block_size
        n = limit // bs - len(self.pool.uncached_full_blocks(seq.token_ids, limit, seq.block_table.root))
        return chain_blocks(seq.token_ids[:n * bs], bs, seq.block_table.root)

    # -- shutdown and reporting --------------------------------------------------------
    def close(self, timeout: float = 10.0) -> bool:
        """Writes every full registered block (at most ``timeout`` seconds, then what is
        left is dropped, never half-written) and closes the tier. True if all was written."""
        deadline = time.monotonic() + timeout
        self.write_registered(timeout)
        return self.tier.close(max(0.0, deadline - time.monotonic()))

    def write_registered(self, timeout: float) -> None:
        """Queues every full registered block not on disk yet (and what the last schedule
        evicted), waiting at most ``timeout`` seconds for room in the writer's queue (0:
        queues what fits now, drops the rest)."""
        deadline = time.monotonic() + timeout
        self.after_schedule()
        # Tails first: the tier's LRU then drops a chain's last blocks before its first ones
        # (a block is of use only after its parent; registration order is head first).
        candidates = self.pool.registered_blocks()[::-1]
        for i in range(0, len(candidates), _SHUTDOWN_BATCH):
            left = deadline - time.monotonic()
            if left <= 0 < timeout:
                break
            self._spill(candidates[i:i + _SHUTDOWN_BATCH], timeout=max(0.0, left))

    def stats(self) -> DiskTierStats:
        return self.tier.stats()


def chain_blocks(token_ids: Sequence[int], block_size: int, root: BlockHash | None = None) -> list[ChainBlock]:
    """The full blocks of ``token_ids`` with their chained keys, from ``root`` (its namespace)."""
    blocks: list[ChainBlock] = []
    parent: BlockHash | None = root
    for i in range(len(token_ids) // block_size):
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        key = chain_hash(parent, tokens)
        blocks.append(ChainBlock(key, parent, tokens))
        parent = key
    return blocks


def chain_keys(token_ids: Sequence[int], block_size: int, root: BlockHash | None = None) -> list[BlockHash]:
    """The chained keys of the full blocks of ``token_ids``, from ``root`` (its namespace)."""
    return [b.key for b in chain_blocks(token_ids, block_size, root)]
