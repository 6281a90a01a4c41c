"""Recovering a lost pipeline stage: the runner's half that notices and replaces it (issue 13).

``StageRecovery`` is mixed into :class:`~bargein.distributed.pipeline.PipelineRunner`
and works on its state: ``actors``, ``placements``, ``pipe`` (the PipelineConfig),
``traffic``, ``recovery`` (RecoveryStats), the plans ``_in_flight``, and the recovery
fields guarded by ``_lock``. The engine thread notices a loss (``_wait_for``,
``_check_stages``) and calls ``_lose``, which kills the lost stages, voids every plan
in flight, starts ``_recover`` on a thread and raises ``KVLost``. The recovery thread
re-creates each lost stage where Ray finds room and sets ``_ready``; until then
``health()`` says "recovering", and "degraded" once ``recovery_timeout_s`` has passed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

import ray

from bargein.distributed.health import first_line, first_not_ready, unanswered
from bargein.distributed.stage import StageCounters, stage_actor
from bargein.distributed.weights import fingerprint, read_stored
from bargein.engine.runner import KVLost, RunnerHealth

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

    def _wait_for(self, refs: list[Any], submitted: float) -> None:
        """Waits for the plan's last stage, with a heartbeat while it takes long and
        the step deadline; raises KVLost for a stage that died or hangs."""
        pipe = self.pipe
        while not ray.wait([refs[-1]], timeout=pipe.heartbeat_interval_s)[0]:
            self._check_stages()
            if time.monotonic() - submitted > pipe.step_timeout_s:
                self._lose({first_not_ready(refs): f"a plan took over {pipe.step_timeout_s:g} s"})

    def _check_stages(self) -> None:
        lost = unanswered(self.actors, self.pipe.heartbeat_timeout_s)
        if lost:
            self._lose(lost)

    def _lose(self, lost: dict[int, str]) -> None:
        """Kills the lost stages, voids every plan in flight, starts re-creating them; raises KVLost."""
        message = "; ".join(
            f"pipeline stage {i} (layers {self.placements[i].layers[0]}-{self.placements[i].layers[1]}) "
            f"on node {self.placements[i].node_address} was lost: {why}" for i, why in sorted(lost.items()))
        log.warning("%s", message)
        with self._lock:
            self._in_flight.clear()
            for i in lost:
                ray.kill(self.actors[i], no_restart=True)
            for i, actor in enumerate(self.actors):
                if i not in lost:  # its runs of those plans, waiting or queued, fail at once
                    actor.void_through.remote(self._seq)
            self.recovery.losses += 1
            self._lost_at, self._lost_message = time.monotonic(), message
            self._ready.clear()
        self._recovery = threading.Thread(target=self._recover, args=(sorted(lost),), daemon=True,
                                          name="bargein-stage-recovery")
        self._recovery.start()
        raise KVLost(message)

    # -- recovery (its own thread) ---------------------------------------------------------
    def _recover(self, indices: list[int]) -> None:
        """Re-creates each lost stage where Ray finds room, retrying until it is ready or
        the runner closes; then the pipeline is "ok" again. A runner built without a
        model source (stand-in stages in a benchmark) cannot re-create: it stays degraded."""
        if self.source is None:
            log.error("pipeline stages %s cannot be re-created: the runner has no model source", indices)
            return
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
        with self._lock:
            self.recovery.recoveries += 1
            if self._lost_at is not None:
                self.recovery.recover_seconds.append(time.monotonic() - self._lost_at)
            self._lost_at = self._lost_message = None
            self._ready.set()
        log.info("pipeline recovered: %s", ", ".join(f"stage {i} on {self.placements[i].node_address}"
                                                       for i in indices))

    def _recreate(self, i: int) -> Any:
        """One try at stage ``i``: returns the ready actor, or None if the runner closed."""
        p = self.placements[i]
        prefer = i in self.pipe.ship_weights
        # Put (not send) the stored tensors: they cross the network only if the node lacks the file.
        shipped = [ray.put(read_stored(self.source, self.model_config, p.layers))]
        expected = fingerprint(self.source)
        actor = stage_actor(self.config, None).remote(
            i, self.config, self.model_config, self.source.kind, self.node_path, expected, p.layers, shipped,
            prefer, self.pipe.threads_per_stage)
        ready = actor.allocate.remote(self.num_blocks, self.block_size)
        while not ray.wait([ready], timeout=0.5)[0]:  # pending until a node has room
            if self._closing.is_set():
                ray.kill(actor)
                return None
        try:
            ray.get(ready)
            counters: StageCounters = ray.get(actor.read_counters.remote())
            with self._lock:
                actors = list(self.actors)
            links = [actor.connect_next.remote(actors[i + 1:i + 2])]
            if i > 0:  # the stage before sends its hidden states to the new actor from its next plan on
                links.append(actors[i - 1].connect_next.remote([actor]))
            ray.get(links)
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

