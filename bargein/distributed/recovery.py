"""Recovering a lost pipeline stage: the runner's half that notices and replaces it (issue 13).

``StageRecovery`` is mixed into :class:`~bargein.distributed.pipeline.PipelineRunner`
and works on its state: ``actors``, ``placements``, ``pipe`` (the PipelineConfig),
``transport`` (how plans reach the actors), ``traffic``, ``recovery`` (RecoveryStats),
the plans ``_in_flight``, and the recovery fields guarded by ``_lock``. A watchdog
thread (``_watch``) pings the stages while a plan is out and kills one that does not
answer in time, which ends the wait for its result with an error; the engine thread,
waiting for a result (``_wait_for``), then finds the loss (or a stage that died by
itself) and calls ``_lose``, which voids every plan in flight, starts ``_recover`` on a
thread and raises ``KVLost``. The recovery thread closes the broken transport,
re-creates each lost stage where Ray finds room, opens a new transport and sets
``_ready``; until then ``health()`` says "recovering", and "degraded" once
``recovery_timeout_s`` has passed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, NoReturn

import ray

from bargein.distributed.health import first_line, unanswered
from bargein.distributed.stage import StageCounters, stage_actor
from bargein.distributed.weights import fingerprint, read_stored
from bargein.engine.runner import KVLost, RunnerHealth, StepFailed

log = logging.getLogger("bargein.distributed")


class StageRecovery:
    """Noticing and replacing lost stages; see the module docstring."""

    actors: list[Any]
    placements: list[Any]
    _lock: threading.Lock
    _ready: threading.Event
    _closing: threading.Event
    _lost_at: float | None
    _lost_message: str | None
    _recovery: threading.Thread | None
    _found_lost: dict[int, str]
    transport: Any
    _seq: int
    kv_tier: Any  # the stages' disk tiers (stage_tiers.StageTiers) or None

    def _wait_for(self, plan: Any, handle: Any, seq: int, submitted: float) -> tuple:
        """The plan's result, waited for until the step deadline (the watchdog meanwhile
        kills a stage that stopped answering, which ends the wait). Raises KVLost for a
        lost stage or a plan past its deadline, StepFailed for a plan a stage failed on
        while every stage still answers."""
        pipe = self.pipe
        error: BaseException
        if isinstance(handle, BaseException):  # handing the plan over failed
            error = handle
        else:
            remaining = pipe.step_timeout_s - (time.monotonic() - submitted)
            try:
                return self.transport.wait(handle, remaining)
            except TimeoutError:
                self._lose({self._holding(seq): f"a plan took over {pipe.step_timeout_s:g} s"})
            except Exception as exc:
                error = exc
        with self._lock:
            lost = dict(self._found_lost)
        lost = lost or unanswered(self.actors, pipe.heartbeat_timeout_s)
        if lost:
            self._lose(lost)
        if isinstance(error, ray.exceptions.RayTaskError):  # a stage failed on this plan
            raise StepFailed(plan, f"a pipeline stage failed: {first_line(error)}") from error
        self._lose({}, f"the pipeline's {self.transport.kind} transport broke ({first_line(error)})")

    def _holding(self, seq: int) -> int:
        """The first stage that has not finished plan ``seq`` (the one holding it up)."""
        with self._lock:
            actors = list(self.actors)
        progress = [a.progress.remote() for a in actors]
        for i, ref in enumerate(progress):
            try:
                if ray.get(ref, timeout=self.pipe.heartbeat_timeout_s) < seq:
                    return i
            except (ray.exceptions.RayError, TimeoutError):
                return i
        return len(actors) - 1

    def _watch(self) -> None:
        """The watchdog (its own thread): while a plan has been out for over a heartbeat
        interval, pings every stage each interval; kills the ones that do not answer
        within ``heartbeat_timeout_s`` (dead, hung or frozen), noting why for ``_wait_for``."""
        pipe = self.pipe
        while not self._closing.wait(pipe.heartbeat_interval_s):
            with self._lock:
                oldest, actors = self._oldest_submitted(), list(self.actors)
            if oldest is None or time.monotonic() - oldest < pipe.heartbeat_interval_s:
                continue
            lost = unanswered(actors, pipe.heartbeat_timeout_s)
            if not lost:
                continue
            with self._lock:
                if not self._in_flight or self.actors != actors:
                    continue  # the plans were given up meanwhile, or stages replaced
                self._found_lost.update(lost)
                for i in lost:
                    ray.kill(actors[i], no_restart=True)
                if self.transport is not None:
                    self.transport.wake()  # the engine thread may be waiting for a ring that will not come
            log.warning("pipeline stages %s stopped answering; killed", sorted(lost))

    def _oldest_submitted(self) -> float | None:
        """When the oldest plan in flight was submitted (under ``_lock``)."""
        return self._in_flight[0][2] if self._in_flight else None

    def _lose(self, lost: dict[int, str], why: str | None = None) -> NoReturn:
        """Kills the lost stages, voids every plan in flight, starts re-creating them and
        opening a new transport (``why``: the loss when no stage was lost, only the
        transport); raises KVLost."""
        message = "; ".join(
            f"pipeline stage {i} (layers {self.placements[i].layers[0]}-{self.placements[i].layers[1]}) "
            f"on node {self.placements[i].node_address} was lost: {reason}" for i, reason in sorted(lost.items())) \
            or why or "the pipeline was lost"
        log.warning("%s", message)
        if self.kv_tier is not None:
            self.kv_tier.lost()
        with self._lock:
            self._in_flight.clear()
            self._found_lost.clear()
            for i in lost:
                ray.kill(self.actors[i], no_restart=True)
            broken, self.transport = self.transport, None
            broken.abandon(self._seq, set(lost))
            self.recovery.losses += 1
            self._lost_at, self._lost_message = time.monotonic(), message
            self._ready.clear()
        self._recovery = threading.Thread(target=self._recover, args=(sorted(lost), broken), daemon=True,
                                          name="bargein-stage-recovery")
        self._recovery.start()
        raise KVLost(message)

    # -- recovery (its own thread) ---------------------------------------------------------
    def _recover(self, indices: list[int], broken: Any) -> None:
        """Closes the broken transport, re-creates each lost stage where Ray finds room
        (retrying until it is ready or the runner closes) and opens a new transport over
        the stages; then the pipeline is "ok" again. A runner built without a model
        source (stand-in stages in a benchmark) cannot re-create: it stays degraded."""
        broken.close()
        if indices and self.source is None:
            log.error("pipeline stages %s cannot be re-created: the runner has no model source", indices)
            return
        while not self._closing.is_set():
            for i in indices:
                while not self._closing.is_set():
                    try:
                        actor = self._recreate(i)
                    except Exception as exc:  # e.g. the node went too; try again
                        log.warning("re-creating pipeline stage %d failed: %s", i, first_line(exc))
                        self._closing.wait(1.0)
                        continue
                    if actor is not None:
                        break
            if self._closing.is_set():
                return
            try:
                transport = self._open_transport(strict=False)
                break
            except Exception as exc:  # a stage died meanwhile: re-create it too
                log.warning("opening the pipeline's transport failed: %s", first_line(exc))
                indices = sorted(unanswered(self.actors, self.pipe.heartbeat_timeout_s))
                for i in indices:
                    ray.kill(self.actors[i], no_restart=True)
                if not indices:
                    self._closing.wait(1.0)
        else:
            return
        with self._lock:
            self.transport = transport
            self.recovery.recoveries += 1
            if self._lost_at is not None:
                self.recovery.recover_seconds.append(time.monotonic() - self._lost_at)
            self._lost_at = self._lost_message = None
            self._ready.set()
        log.info("pipeline recovered: %s", ", ".join(f"stage {i} on {self.placements[i].node_address}"
                                                       for i in indices) or f"{transport.kind} transport opened afresh")

    def _recreate(self, i: int) -> Any:
        """One try at stage ``i``: returns the ready actor, or None if the runner closed."""
        p = self.placements[i]
        prefer = i in self.pipe.ship_weights
        # Put (not send) the stored tensors: they cross the network only if the node lacks the file.
        shipped = [ray.put(read_stored(self.source, self.model_config, p.layers))]
        expected = fingerprint(self.source)
        actor = stage_actor(self.config, None, p.num_cpus).remote(  # the threads it was planned with
            i, self.config, self.model_config, self.source.kind, self.node_path, expected, p.layers, shipped,
            prefer, p.threads)
        ready = actor.allocate.remote(self.num_blocks, self.block_size)
        while not ray.wait([ready], timeout=0.5)[0]:  # pending until a node has room
            if self._closing.is_set():
                ray.kill(actor)
                return None
        try:
            ray.get(ready)
            if self.kv_tier is not None:
                self.kv_tier.reopen(actor)
            counters: StageCounters = ray.get(actor.read_counters.remote())
        except BaseException:
            ray.kill(actor)
            raise
        node = next((n for n in ray.nodes() if n["NodeID"] == counters.node_id), {})
        with self._lock:
            self.actors[i] = actor
            self.placements[i] = replace(p, node_id=counters.node_id,
                                         node_address=node.get("NodeManagerAddress", "?"),
                                         node_memory_bytes=int(node.get("Resources", {}).get("memory", 0)))
            self.recovery.restarts[i] += 1
            self.traffic.weights_shipped_bytes += counters.weights_received_bytes
        return actor

    # -- health ------------------------------------------------------------------------
    def health(self) -> RunnerHealth:
        """ok, recovering (plans wait), or degraded (past ``recovery_timeout_s``: plans fail)."""
        with self._lock:
            if self._lost_at is None:
                return RunnerHealth()
            message = self._lost_message
            waited = time.monotonic() - self._lost_at
        if waited <= self.pipe.recovery_timeout_s:
            return RunnerHealth("recovering", message)
        return RunnerHealth("degraded", f"{message}; no node could host it within "
                                        f"{self.pipe.recovery_timeout_s:g} s")

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

