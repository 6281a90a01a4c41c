"""A pipeline's disk tier as its head sees it: every stage's own tier, used as one.

Each stage keeps its layers' blocks on its node (``stage_disk.py``); the head's engine
talks to them through this ``KVTier`` (``engine/kv_disk/kv_tier.py``), on the engine's
thread, never waiting on a stage:

- Keys: the head keeps the keys every stage holds (``present``), bounded as the stages'
  tiers are (each stage gets the same number of blocks: ``--kv-disk-size`` split in
  proportion to the size of each stage's block files). It starts as the keys all stages
  found in their directories; a spill adds its key at once (a write a stage drops or
  evicts costs a read that comes back short, then the key is forgotten).
- Spills, installs and deletions are recorded as operations (``kv_disk/stage_ops.py``)
  that the next plan carries to every stage (``take_ops``, called by the runner's
  ``submit``), so they are ordered with the plans exactly as the pool ordered them.
  Deletions alone while no plan is in flight go out at once, on the stages' disk threads.
- Reads: ``load`` asks every stage to read the chain on its disk thread; the load is
  done when all have answered, and its usable blocks are the fewest any stage read: a
  block is used only when every stage has it (a lost or re-created stage answers 0).
  The blocks' K/V stays on the stages until an install puts it into its block ids.
- A lost stage (``lost``): the operations not sent yet are dropped but for deletions (a
  spill after the loss would copy a re-created stage's empty caches); a re-created stage
  opens its tier again (``reopen``; on another node its directory may hold other
  blocks), and the keys it lacks are forgotten.
- Stats: the stages' counters are fetched in the background (the last answer is
  reported); blocks, hits and misses are the head's own (usable blocks).

``close`` hands the last operations (shutdown's spills of every registered block) to
every stage, which writes them within the time limit and lets its directory go.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import ray

from bargein.config import CacheConfig
from bargein.distributed.health import first_line
from bargein.distributed.stage_disk import StageTierBusy, StageTierOpened
from bargein.engine.block_keys import BlockHash, ChainBlock, SpillCandidate
from bargein.engine.kv_disk.block_file import BlockRecord, file_size
from bargein.engine.kv_disk.fingerprint import ModelFingerprint, identity_files
from bargein.engine.kv_disk.index import DiskIndex, RebuildReport
from bargein.engine.kv_disk.stage_ops import DeleteBlocks, InstallLoad, KVDiskOp
from bargein.engine.kv_disk.stats import DiskTierStats
from bargein.engine.kv_disk.tier import Loaded

log = logging.getLogger("bargein.distributed")

_REOPEN_TRIES_S = 10.0  # a re-created stage waits this long at most for the lost one's lock to go
_BUSY_WAIT_S = 5.0  # at start, for the stages of a server killed moments ago to let their directories go


class StageTiers:
    """Every stage's tier as one ``KVTier`` (see the module docstring). ``runner`` is the
    :class:`~bargein.distributed.pipeline.PipelineRunner` (its current actors, its plans
    in flight)."""

    def __init__(self, runner: Any, base: str, files: tuple[tuple[str, int, str], ...], blocks: int,
                 opened: Sequence[StageTierOpened], on_loaded: Callable[[], object]):
        self._runner = runner
        self._base, self._files, self._blocks = base, files, blocks
        first, last = opened[0].fingerprint, opened[-1].fingerprint
        # The whole model's layers: the same digest as one process's tier (Conversation.save carries it).
        self.fingerprint: ModelFingerprint = replace(first, layer_range=(first.layer_range[0], last.layer_range[1]))
        self._capacity = min(o.capacity_blocks for o in opened)
        self._keys = DiskIndex(self._capacity)  # one "byte" per block: the LRU of usable keys
        common = set.intersection(*(set(o.keys) for o in opened))
        for key in opened[0].keys:
            if key in common:
                self._keys.add(key, 1)
        reports = [o.rebuild for o in opened]
        self._rebuild = RebuildReport(self._keys.num_blocks, sum(r.bytes for r in reports),
                                      sum(r.removed_partial for r in reports), sum(r.removed_foreign for r in reports),
                                      sum(r.evicted for r in reports), max(r.seconds for r in reports))
        self._on_loaded = on_loaded
        self._ops: list[KVDiskOp] = []
        self._loads: dict[Hashable, tuple[tuple[ChainBlock, ...], list[Any]]] = {}
        self._reopened: list[StageTierOpened | None] = []  # from the recovery thread, applied on the engine's
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self._stage_stats: list[DiskTierStats | None] = []
        self._stats_refs: list[Any] | None = None
        self._closed = False

    @classmethod
    def open(cls, runner: Any, cache: CacheConfig, model_identity: str | os.PathLike[str],
             on_loaded: Callable[[], object]) -> StageTiers | None:
        """Opens every stage's tier, or none (after a warning that says why): the bound too
        small for one block per stage, a stage's directory unusable, or owned by another
        process (named, once the wait for a killed server's stages is over: ``_open_stages``)."""
        assert cache.kv_disk_dir is not None
        actors = list(runner.actors)
        bs = cache.block_size
        sizes = [file_size(bs, p) for p in ray.get([a.kv_bytes_per_block.remote(bs) for a in actors])]
        blocks = cache.kv_disk_bytes // sum(sizes)
        if blocks < 1:
            log.warning("kv disk: %d bytes hold no block of every stage (%d bytes): running without it",
                        cache.kv_disk_bytes, sum(sizes))
            return None
        files = identity_files(model_identity)
        opened = _open_stages(actors, cache.kv_disk_dir, files, blocks)
        refused = [o for o in opened if not isinstance(o, StageTierOpened)]
        if refused:
            ray.get([a.kv_disk_close.remote([], 0.0) for a in actors])
            for reason in refused:
                log.warning("kv disk: %s: the pipeline runs without the disk tier", reason)
            return None
        return cls(runner, cache.kv_disk_dir, files, blocks, opened, on_loaded)  # type: ignore[arg-type]

    # -- KVTier ----------------------------------------------------------------------------
    @property
    def rebuild(self) -> RebuildReport:
        return self._rebuild

    @property
    def num_blocks(self) -> int:
        return self._keys.num_blocks

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._keys

    def present(self, keys: Sequence[BlockHash]) -> int:
        return self._keys.leading_present(keys)

    def spill_blocks(self, candidates: Sequence[SpillCandidate], timeout: float = 0.0) -> int:
        """Records the spills of the candidates not on disk yet (every stage copies its
        K/V out before the next plan's forward); returns how many."""
        fresh = [c for c in candidates if c.block.key not in self._keys]
        self._ops.extend(fresh)
        for c in fresh:
            self._keys.add(c.block.key, 1)
        return len(fresh)

    def load(self, ticket: Hashable, wanted: Sequence[ChainBlock]) -> None:
        wanted = tuple(wanted)
        refs = [a.kv_disk_read.remote(str(ticket), list(wanted)) for a in self._actors()]
        self._loads[ticket] = (wanted, refs)
        for ref in refs:
            ref.future().add_done_callback(lambda _done: self._on_loaded())

    def drain_loaded(self) -> list[Loaded]:
        """Loads every stage has answered: their leading blocks that all stages read."""
        self._apply_reopened()
        done: list[Loaded] = []
        for ticket, (wanted, refs) in list(self._loads.items()):
            if len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
                continue
            del self._loads[ticket]
            n = min(_count(ref) for ref in refs)
            self.hits += n
            self.misses += len(wanted) - n
            if n < len(wanted):
                self._keys.remove(wanted[n].key)  # some stage lacks it: not usable
            for block in reversed(wanted[:n]):
                self._keys.touch(block.key)
            done.append(Loaded(ticket, len(wanted), tuple(BlockRecord(b.key, b.parent, b.tokens, b"")
                                                          for b in wanted[:n])))
        self._send_if_idle()
        return done

    def install(self, loaded: Loaded, placed: Sequence[tuple[BlockHash, int]]) -> None:
        self._ops.append(InstallLoad(str(loaded.ticket), tuple(placed)))

    def delete(self, keys: Iterable[BlockHash]) -> None:
        keys = tuple(keys)
        if keys:
            for key in keys:
                self._keys.remove(key)
            self._ops.append(DeleteBlocks(keys))
            self._send_if_idle()

    def close(self, timeout: float | None = 10.0) -> bool:
        """Every stage applies the last operations and writes within ``timeout`` seconds."""
        if self._closed:
            return True
        self._closed = True
        limit = 10.0 if timeout is None else timeout
        ops = self.take_ops()
        try:
            return all(ray.get([a.kv_disk_close.remote(list(ops), limit) for a in self._actors()],
                               timeout=limit + 30))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("kv disk: a stage did not close its tier: %s", exc)
            return False

    def stats(self) -> DiskTierStats:
        """The stages' last reported counters, merged; asks for fresh ones in the background."""
        refs = self._stats_refs
        if refs is not None and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs):
            self._stage_stats = [_stats(ref) for ref in refs]
            refs = self._stats_refs = None
        if refs is None and not self._closed:
            self._stats_refs = [a.kv_disk_stats.remote() for a in self._actors()]
        return self._merged()

    # -- the runner's side -------------------------------------------------------------------
    def take_ops(self) -> tuple[KVDiskOp, ...]:
        """The operations the next plan carries to every stage (the runner's ``submit``)."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def lost(self) -> None:
        """A stage was lost (engine thread, before ``KVLost``): operations not sent yet are
        dropped but for deletions, since every block's K/V is gone."""
        self._ops = [op for op in self._ops if isinstance(op, DeleteBlocks)]

    def reopen(self, actor: Any) -> None:
        """A re-created stage opens its tier (the recovery thread); its keys are applied
        on the engine's thread. Retries while the lost stage's lock is still held."""
        (opened,) = _open_stages([actor], self._base, self._files, self._blocks, _REOPEN_TRIES_S)
        if not isinstance(opened, StageTierOpened):
            log.warning("kv disk: the re-created stage has no tier (%s): no block is read back until a restart",
                        opened)
        with self._lock:
            self._reopened.append(opened if isinstance(opened, StageTierOpened) else None)

    def stage_stats(self, timeout: float = 30.0) -> list[DiskTierStats | None]:
        """Every stage's own counters, now (for tests and benchmarks)."""
        return ray.get([a.kv_disk_stats.remote() for a in self._actors()], timeout=timeout)

    # -- inside ----------------------------------------------------------------------------
    def _actors(self) -> list[Any]:
        return self._runner.current_actors()

    def _apply_reopened(self) -> None:
        with self._lock:
            reopened, self._reopened = self._reopened, []
        for opened in reopened:
            held = set() if opened is None else set(opened.keys)
            for key in self._keys.lru_keys():
                if key not in held:
                    self._keys.remove(key)

    def _send_if_idle(self) -> None:
        """Deletions alone, with no plan in flight, go now (no plan may follow for a while)."""
        if (self._ops and self._runner.num_in_flight == 0
                and all(isinstance(op, DeleteBlocks) for op in self._ops)):
            ops = self.take_ops()
            for actor in self._actors():
                actor.kv_disk_apply.remote(list(ops))

    def _merged(self) -> DiskTierStats:
        parts = [p for p in self._stage_stats if p is not None]

        def most(name: str) -> float:
            return max((getattr(p, name) for p in parts), default=0)

        return DiskTierStats(
            blocks=self._keys.num_blocks, bytes=sum(p.bytes for p in parts), max_bytes=sum(p.max_bytes for p in parts),
            hits=self.hits, misses=self.misses, writes=min((p.writes for p in parts), default=0),
            dropped_writes=int(most("dropped_writes")), deleted=min((p.deleted for p in parts), default=0),
            skipped_files=sum(p.skipped_files for p in parts), queued_writes=int(most("queued_writes")),
            read_seconds_mean=most("read_seconds_mean"), read_seconds_max=most("read_seconds_max"),
            write_seconds_mean=most("write_seconds_mean"), write_seconds_max=most("write_seconds_max"),
            rebuild_seconds=self._rebuild.seconds)


def _open_stages(actors: Sequence[Any], base: str, files: tuple[tuple[str, int, str], ...], blocks: int,
                 busy_wait_s: float = _BUSY_WAIT_S) -> list[StageTierOpened | str]:
    """Each stage's tier opened, or why not. A directory another process holds is asked
    for again every 0.2 s for ``busy_wait_s``: the stages of a server killed moments ago
    (``kill -9``, a crash) hold their locks until Ray has ended their processes, which
    takes a moment after the head's death; a server that really runs on the directory
    still holds it after the wait, and is named."""
    answers: list[StageTierOpened | str | None] = [None] * len(actors)
    deadline = time.monotonic() + busy_wait_s
    while True:
        asked = [i for i, a in enumerate(answers) if a is None or isinstance(a, StageTierBusy)]
        refs = [actors[i].open_kv_disk.remote(base, files, blocks) for i in asked]
        for i, ref in zip(asked, refs, strict=True):
            try:
                answers[i] = ray.get(ref)
            except ray.exceptions.RayError as exc:  # e.g. a node where DIR cannot be made
                answers[i] = f"a stage cannot use {base}: {first_line(exc)}"
        if not any(isinstance(a, StageTierBusy) for a in answers) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [a.reason if isinstance(a, StageTierBusy) else a for a in answers]  # type: ignore[misc]


def _count(ref: Any) -> int:
    """A stage's answer to a read: blocks read; 0 if it failed (a lost stage)."""
    try:
        return int(ray.get(ref))
    except ray.exceptions.RayError:
        return 0


def _stats(ref: Any) -> DiskTierStats | None:
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None
