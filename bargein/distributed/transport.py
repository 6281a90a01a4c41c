"""How plans reach a pipeline's stages and results come back: two transports over Ray.

``CompiledGraph`` (``graph``): the stages form one Ray compiled graph. The head's input
``(seq, pickled plan, pickled rows)`` goes to every stage's ``step``; stage k's output is
stage k+1's second argument; the last stage's output is the graph's. Ray compiles it
once into shared-memory channels and a loop on each stage's own thread, so a plan
crosses a hop in tens of microseconds where an actor call takes a millisecond or more
(``bench/bench_pipeline.py`` runs both). A channel's reader polls until its data is
there, taking a core while it waits; the head therefore waits on a doorbell before it
reads, and a graph is used only where every stage runs on the head's node with a core
per stage thread (``pick_transport``).
Across nodes Ray 2.60's graph channels gained nothing measurable here, hung with three
stages and three plans in flight, and crashed a raylet in about half of the teardowns
(a 30-line script reproduces each).

``ActorCalls`` (``calls``): the head calls every stage's ``run``; a stage calls the next
stage's ``receive`` with its hidden states (see ``stage``). Used elsewhere.

Both give the same results in the same order. ``wait`` raises ``TimeoutError`` past the
deadline, a ``ray.exceptions.RayTaskError`` for a plan a stage failed on, and any other
error where a stage died or the transport broke (the runner then finds out which).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import tempfile
import time
from typing import Any

import ray
from ray.dag import InputNode

from bargein.distributed.errors import PipelineSetupError

log = logging.getLogger("bargein.distributed")

_BROKEN_CHECK_S = 0.05  # while waiting for a ring, how often the head checks that the graph still stands

class ActorCalls:
    """Plans by actor calls; hidden states by calls from stage to stage."""

    kind = "calls"

    def __init__(self, actors: list[Any]):
        self.actors = list(actors)
        ray.get([a.connect_next.remote(self.actors[i + 1:i + 2]) for i, a in enumerate(self.actors)])

    def submit(self, seq: int, payload: bytes, rows: bytes | None) -> list[Any]:
        """The first stage's call goes first: it starts while the others are sent."""
        last = len(self.actors) - 1
        return [actor.run.remote(seq, payload, i > 0, rows if i == last else None)
                for i, actor in enumerate(self.actors)]

    def wait(self, refs: list[Any], timeout_s: float) -> tuple:
        """The last stage's result; a stage's error as soon as any stage raises it."""
        ends = time.monotonic() + timeout_s
        pending = list(refs)
        while True:
            ready, _ = ray.wait(pending, num_returns=1, timeout=max(0.0, ends - time.monotonic()))
            if not ready:
                raise TimeoutError
            value = ray.get(ready[0])
            if ready[0] == refs[-1]:
                return value
            pending.remove(ready[0])

    def wake(self) -> None:
        pass  # a killed stage's calls fail by themselves

    def abandon(self, through_seq: int, lost: set[int]) -> None:
        """The plans up to ``through_seq`` are given up: the surviving stages fail the ones
        they wait for or have queued at once."""
        for i, actor in enumerate(self.actors):
            if i not in lost:
                actor.void_through.remote(through_seq)

    def close(self) -> None:
        pass


class CompiledGraph:
    """Plans, hidden states and results through one compiled graph of the stages.

    Ray's channel read polls until its data is there, so the head does not read a result
    before it is done: it waits, without spinning, on a doorbell (a FIFO on this node,
    where every stage runs) that the last stage rings when it finished a plan's forward
    (the head wakes while the tokens are picked and sent), a stage rings when it failed one, and the watchdog rings when it killed a stage; then it
    reads. One ring per plan; a stray one only makes the head read (and poll) early.
    """

    kind = "graph"

    def __init__(self, actors: list[Any], capacity: int, submit_timeout_s: float):
        """``capacity``: plans in flight the graph holds (its channels keep a buffer per
        plan); writing a plan waits up to ``submit_timeout_s`` for room."""
        self._folder = tempfile.mkdtemp(prefix="bargein-doorbell-")
        path = os.path.join(self._folder, "ring")
        os.mkfifo(path, 0o600)
        self._bell = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._ringer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        self._rings = 0  # rung, not yet waited for
        try:
            ray.get([actor.ring_on.remote(path) for actor in actors])
            with InputNode() as plan:
                out = None
                for actor in actors:
                    out = actor.step.bind(plan) if out is None else actor.step.bind(plan, out)
            self.graph = out.experimental_compile(_max_inflight_executions=capacity,
                                                  _submit_timeout=submit_timeout_s)
        except BaseException:
            self._close_bell()
            raise

    def submit(self, seq: int, payload: bytes, rows: bytes | None) -> Any:
        return self.graph.execute((seq, payload, rows))

    def wait(self, ref: Any, timeout_s: float) -> tuple:
        ends = time.monotonic() + timeout_s
        while self._rings == 0:
            remaining = ends - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if select.select([self._bell], [], [], min(remaining, _BROKEN_CHECK_S))[0]:
                with contextlib.suppress(BlockingIOError):
                    self._rings += len(os.read(self._bell, 4096))
            elif self.graph.is_teardown:  # Ray tore it down (a stage died): reading says why
                self._rings += 1
        self._rings -= 1
        try:
            return ref.get(timeout=max(ends - time.monotonic(), 0.001))
        except ray.exceptions.RayChannelTimeoutError:
            raise TimeoutError from None

    def wake(self) -> None:
        """Rings the doorbell from the head (the watchdog killed a stage)."""
        with contextlib.suppress(OSError):
            os.write(self._ringer, b"w")

    def abandon(self, through_seq: int, lost: set[int]) -> None:
        pass  # the graph is torn down (``close``) before a new one is compiled

    def close(self) -> None:
        """Stops the graph's loops on the stages and frees its channels; a graph already
        broken by a dead stage is torn down as far as it goes, without raising."""
        try:
            self.graph.teardown()
        except Exception as exc:  # e.g. an actor of it died: Ray has torn down what it could
            log.debug("tearing down the pipeline's graph: %s", exc)
        self._close_bell()

    def _close_bell(self) -> None:
        for fd in (self._bell, self._ringer):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self._folder, ignore_errors=True)


def pick_transport(kind: str, node_ids: list[str], head_node: str, head_node_cpus: float, stage_threads: int,
                   *, strict: bool = True) -> str:
    """"graph" or "calls" for a pipeline whose stage i runs on ``node_ids[i]``.

    "auto": a compiled graph where every stage runs on the head's node and the node has a
    CPU for each stage's threads (a stage's graph thread polls its channel while it waits
    for input, which must not take a core another stage computes on; the head waits on
    its doorbell instead); else actor calls. "graph" and "calls" force one; "graph" needs
    every stage on the head's node: refused at start (``strict``), and actor calls after a
    stage was re-created elsewhere.
    """
    one_node = all(n == head_node for n in node_ids)
    if kind == "graph":
        if one_node:
            return "graph"
        if strict:
            raise PipelineSetupError("the graph transport needs every pipeline stage on the head's node; "
                                     "use --pipeline-transport auto or calls across nodes")
        log.warning("a pipeline stage runs off the head's node: actor calls instead of a compiled graph")
        return "calls"
    if kind == "calls" or not one_node:
        return "calls"
    return "graph" if head_node_cpus >= len(node_ids) * stage_threads else "calls"


def open_transport(kind: str, actors: list[Any], node_ids: list[str], stage_threads: int, capacity: int,
                   submit_timeout_s: float, *, strict: bool = True) -> ActorCalls | CompiledGraph:
    """The transport ``pick_transport`` picks, over ``actors``, opened."""
    here = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == here), {})
    cpus = float(node.get("Resources", {}).get("CPU", 0))
    if pick_transport(kind, node_ids, here, cpus, stage_threads, strict=strict) == "graph":
        return CompiledGraph(actors, capacity, submit_timeout_s)
    return ActorCalls(actors)
