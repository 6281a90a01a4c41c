"""The pipeline runner: the engine's runner seam over N stage actors on a Ray cluster.

``submit(plan)`` pickles the plan once and hands it to the stages through the
pipeline's transport (``transport``: a Ray compiled graph where every stage runs on
this node with cores to spare, actor calls elsewhere); stage k's hidden states go to
stage k+1 without passing through this process. ``collect()`` waits for the oldest plan's logits. Plain
sampled rows (``sampler.row_sampling``: no grammar, penalties or logprobs) are sampled
on the last stage, which sends their token ids instead of their logits rows. Up to
``max_in_flight`` plans (micro-batches) are in flight; the engine's scheduler never puts
a sequence in two of them, and every stage runs plans in submission order.

Set-up (``start``) is all or nothing: it connects to Ray, places one stage per node
(the nodes with the most memory first; several stages share a node when there are
fewer nodes), splits the layers by node memory unless given, loads or ships each
stage's weights, sizes the one KV pool to the smallest stage's budget and opens the
transport. Any problem raises :class:`PipelineSetupError` with one line, after killing
what it started.

Bytes through the head are counted: the pickled plans sent (once per stage), the logits
received and the weights shipped. Hidden states are counted by the stages that send them.

A lost stage (issue 13, see ``recovery`` and ``health``): a watchdog thread pings the
stages while a plan is out and kills one that does not answer; ``collect`` then finds
the loss (or a stage that died by itself), drops every plan in flight, starts
re-creating the stage on a background thread, and raises ``KVLost``: the engine then
drops every block's K/V and recomputes its sequences from their tokens once
``health()`` is "ok" again. A stage is re-created where Ray finds room (a free CPU, and
the ``node_resource`` if set); it reads the model file if its node has it, else fetches
the tensors the head put in the object store; then the transport is opened afresh. Past
``recovery_timeout_s`` the runner says "degraded" (the engine fails what waits) and
keeps trying, so it heals by itself when capacity returns.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from bargein.config import CacheConfig, EngineConfig, ModelConfig
from bargein.distributed.connect import connect
from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.model_copy import has_model_copy
from bargein.distributed.split import (
    LayerRanges,
    MatrixWidths,
    check_split,
    head_layers,
    speed_factors,
    split_by_memory,
    split_reason,
    stage_weight_bytes,
)
from bargein.distributed.weights import fingerprint, read_stored
from bargein.distributed.widths import stage_widths
from bargein.distributed.worker_env import describe_wait_policy
from bargein.engine.device import resolve_dtype
from bargein.engine.plan import StepPlan
from bargein.engine.runner import (
    PipelineInfo,
    RecoveryInfo,
    RunnerInfo,
    StageInfo,
    StageWork,
    StepFailed,
    StepResult,
    TrafficInfo,
)
from bargein.engine.sampler import RowSampling
from bargein.loader.source import ModelSource

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from bargein.distributed.calibrate import LayerShapes, measure_nodes
    from bargein.distributed.health import RecoveryStats, first_line
    from bargein.distributed.recovery import StageRecovery
    from bargein.distributed.stage import StageCounters, stage_actor
    from bargein.distributed.stage_threads import stage_threads
    from bargein.distributed.stage_tiers import StageTiers
    from bargein.distributed.transport import (
        ActorCalls,
        CompiledGraph,
        open_transport,
        pick_transport,
    )
except ModuleNotFoundError as exc:  # the optional extra is missing: start() says so in one line
    if exc.name != "ray" and not (exc.name or "").startswith("ray."):
        raise
    ray = None
    StageRecovery = object  # type: ignore[misc,assignment]  # nothing runs without Ray: start() refuses

log = logging.getLogger("bargein.distributed")

_MIN_BLOCKS = 16
_MIN_CAPACITY = 4  # plans a compiled graph can hold, at least (its channels keep a buffer per plan)


@dataclass(frozen=True)
class StagePlacement:
    """Where a stage runs and what it holds."""

    index: int
    layers: tuple[int, int]
    node_id: str
    node_address: str
    node_memory_bytes: int  # this stage's share of its node's memory
    threads: int = 1  # its compute threads (stage_threads)
    num_cpus: float = 1.0  # the Ray CPUs its actor takes


@dataclass
class HeadTraffic:
    """The head's running byte counts; ``describe()`` reports them as a frozen
    :class:`~bargein.engine.runner.TrafficInfo` (same fields), which also sums them."""

    plan_bytes: int = 0
    logits_bytes: int = 0
    weights_shipped_bytes: int = 0


def check_layout(num_stages: int, model_config: ModelConfig, given: LayerRanges | None) -> None:
    """The checks that need no cluster, made before connecting to one."""
    if num_stages > model_config.num_layers:
        raise PipelineSetupError(f"{num_stages} stages were asked for, but the model has only "
                                 f"{model_config.num_layers} layers")
    if given is not None:
        check_split(given, model_config.num_layers)


def place_stages(num_stages: int, model_config: ModelConfig, config: EngineConfig,
                 given: LayerRanges | None, widths: MatrixWidths, *,
                 recalibrate: bool = False) -> tuple[list[StagePlacement], str]:
    """Stage i on the i-th node by memory (cycling when stages outnumber nodes); layers
    split so that each stage's work (the last one's LM head included, priced by the bytes
    stages read per value of each matrix, ``widths``) is in proportion to its share of its
    node's memory times its node's speed factor (measured, see ``calibrate``), unless
    ``given``. Each stage's threads: as given, else its node's offer (``stage_threads``).
    Returns the placements and one line saying what the split weighed.
    ``recalibrate``: measure every node now, not from its cached calibration."""
    resource = config.pipeline.node_resource if config.pipeline else None
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0
             and (resource is None or n["Resources"].get(resource, 0) > 0)]
    if not nodes:
        offering = f" offering the resource {resource!r}" if resource else ""
        raise PipelineSetupError(f"the Ray cluster has no live node with a CPU{offering}")
    nodes.sort(key=lambda n: -n["Resources"].get("memory", 0))
    chosen = [nodes[i % len(nodes)] for i in range(num_stages)]
    if config.pipeline is not None and config.pipeline.node_ids is not None:  # placed by a replica set
        by_id = {n["NodeID"]: n for n in nodes}
        missing = [n for n in config.pipeline.node_ids if n not in by_id]
        if missing:
            raise PipelineSetupError(f"node {missing[0][:12]} given for a stage is not a live node with a CPU")
        chosen = [by_id[n] for n in config.pipeline.node_ids]
    sharing = {n["NodeID"]: sum(c["NodeID"] == n["NodeID"] for c in chosen) for n in chosen}
    shares = [int(n["Resources"].get("memory", 0) // sharing[n["NodeID"]]) for n in chosen]
    num_layers = model_config.num_layers
    if num_stages > num_layers:
        raise PipelineSetupError(f"{num_stages} stages were asked for, but the model has only {num_layers} layers")
    addresses = [n["NodeManagerAddress"] for n in chosen]
    threads = stage_threads(chosen, config.pipeline.threads_per_stage if config.pipeline else 1)
    if given is not None:
        ranges, reason = check_split(given, num_layers), "as given (--stage-layers)"
    else:
        rates = None
        if len(set(addresses)) > 1:  # nodes at one address share its CPUs: nothing to weigh
            one_per_address = {n["NodeManagerAddress"]: n["NodeID"] for n in chosen}
            per_node = {n["NodeID"]: t.threads for n, t in zip(chosen, threads, strict=True)}
            speeds = measure_nodes({node: address for address, node in one_per_address.items()}, per_node,
                                   LayerShapes.of(model_config), refresh=recalibrate)
            if len(speeds) == len(one_per_address):
                rates = [speeds[one_per_address[a]].layers_per_s for a in addresses]
        weights = [m * f for m, f in zip(shares, speed_factors(rates) if rates else [1.0] * len(shares), strict=True)]
        ranges = split_by_memory(num_layers, weights, head_layers(model_config, widths))
        reason = split_reason(addresses, shares, rates)
    return [StagePlacement(i, ranges[i], n["NodeID"], n["NodeManagerAddress"], shares[i], t.threads, t.num_cpus)
            for i, (n, t) in enumerate(zip(chosen, threads, strict=True))], reason


@dataclass(frozen=True)
class _StageSource:
    """What any node needs to build stage ``index``: the model file's path as nodes see
    it, its fingerprint, and whether the head must ship the tensors regardless."""

    kind: str
    node_path: str
    expected: Any
    prefer_shipped: bool


class PipelineRunner(StageRecovery):
    """Drives the stage actors; see the module docstring (and ``recovery`` for a lost stage)."""

    def __init__(self, actors: list[Any], placements: list[StagePlacement], model_config: ModelConfig,
                 num_blocks: int, block_size: int, config: EngineConfig, traffic: HeadTraffic,
                 source: ModelSource | None = None, node_path: str | None = None):
        self.actors = actors
        self.placements = placements
        self.model_config = model_config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.config = config
        self.pipe = config.pipeline
        # A compiled graph holds this many plans at most; max_in_flight may be changed up to it.
        self.capacity = max(_MIN_CAPACITY, self.pipe.max_in_flight)
        self._max_in_flight = self.pipe.max_in_flight
        self.device = torch.device("cpu")  # logits arrive here
        self.traffic = traffic
        self.split_reason = ""  # what the layer split weighed (set by start)
        self.source = source
        self.node_path = node_path or (str(source.path) if source is not None else "")
        # (plan, the transport's handle on its result or the error submitting it, submitted at, seq)
        self._in_flight: deque[tuple[StepPlan, Any, float, int]] = deque()
        # Set by the engine: a sampled row's RowSampling if it is plain. The last stage
        # then picks its token and sends an integer instead of a row of logits.
        self.row_sampling: Callable[[str], RowSampling | None] | None = None
        self._seq = 0
        self.collect_wait_s = 0.0  # time the head spent waiting for logits
        self.logits_transfer_s = 0.0  # of that, from the last stage's send to the logits being here
        # Recovery state: written by the engine thread (a loss) and the recovery thread.
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._ready.set()
        self._closing = threading.Event()
        self._lost_at: float | None = None
        self._lost_message: str | None = None
        self._recovery: threading.Thread | None = None
        self.recovery = RecoveryStats(len(actors))
        self._found_lost: dict[int, str] = {}  # stages the watchdog killed, with why
        self.kv_tier: StageTiers | None = None  # the stages' own disk tiers (open_kv_tier), driven by the plans
        self.transport = self._open_transport()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="bargein-stage-watchdog")
        self._watchdog.start()

    # -- set-up ------------------------------------------------------------------------
    @classmethod
    def start(cls, source: ModelSource, model_config: ModelConfig, config: EngineConfig, *,
              node_path: str | None = None) -> PipelineRunner:
        """Starts every stage or none; raises PipelineSetupError saying why in one line.

        ``node_path``: the model's path as the nodes should look it up (a path that
        starts with ``~`` means each node's own home); default the head's path."""
        pipe = config.pipeline
        if pipe is None:
            raise ValueError("EngineConfig.pipeline is not set")
        check_layout(pipe.stages, model_config, pipe.stage_layers)
        connect(pipe.ray_address, pipe.stages)
        placements, reason = place_stages(pipe.stages, model_config, config, pipe.stage_layers,
                                          stage_widths(source, model_config, config))
        if pipe.transport == "graph":  # refused now, not after every stage has loaded
            pick_transport("graph", [p.node_id for p in placements], ray.get_runtime_context().get_node_id(),
                           0.0, 1)
        actors: list[Any] = []
        try:
            runner = cls._start_stages(source, model_config, config, placements, actors,
                                       node_path or str(source.path))
            runner.split_reason = reason
            log.info("layer split %s", reason)
            return runner
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise

    @classmethod
    def _start_stages(cls, source: ModelSource, model_config: ModelConfig, config: EngineConfig,
                      placements: list[StagePlacement], actors: list[Any], node_path: str) -> PipelineRunner:
        pipe = config.pipeline
        traffic = HeadTraffic()
        element = torch.tensor([], dtype=resolve_dtype(config.dtype, torch.device("cpu"))).element_size()
        expected = fingerprint(source)
        for p in placements:
            needed = stage_weight_bytes(model_config, p.layers, element)
            if needed > p.node_memory_bytes:
                raise PipelineSetupError(
                    f"stage {p.index} (layers {p.layers[0]}-{p.layers[1]}) needs {needed / 2**20:.0f} MiB "
                    f"for its weights, but its node {p.node_address} offers {p.node_memory_bytes / 2**20:.0f} MiB")
        # Every node asked at once: an answer starts a worker process there (a second or more).
        probe = ray.remote(num_cpus=0)(has_model_copy)
        asked = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(p.node_id, soft=False)).remote(
            node_path, source.kind, expected) for p in placements]
        for p, answer in zip(placements, asked, strict=True):
            on_node = NodeAffinitySchedulingStrategy(p.node_id, soft=False)
            try:
                has_copy = ray.get(answer)
            except ray.exceptions.RayError as exc:  # e.g. the node went away since Ray listed it
                raise PipelineSetupError(f"node {p.node_address} (for stage {p.index}) did not answer: "
                                         f"{first_line(exc)}") from None
            shipped = None
            if not has_copy or p.index in pipe.ship_weights:
                stored = read_stored(source, model_config, p.layers)
                traffic.weights_shipped_bytes += stored.nbytes
                shipped = [ray.put(stored)]
            spec = _StageSource(source.kind, node_path, expected, p.index in pipe.ship_weights)
            actors.append(stage_actor(config, on_node, p.num_cpus).remote(
                p.index, config, model_config, spec.kind, spec.node_path, spec.expected, p.layers, shipped,
                spec.prefer_shipped, p.threads))
        block_size = config.cache.block_size
        try:
            per_block = ray.get([a.kv_bytes_per_block.remote(block_size) for a in actors])
        except ray.exceptions.RayError as exc:
            raise PipelineSetupError(f"a pipeline stage failed to start: {first_line(exc)}") from None
        num_blocks = config.cache.counted_blocks
        if num_blocks is None:
            budgets = [min(config.cache.memory_bytes,
                           p.node_memory_bytes - stage_weight_bytes(model_config, p.layers, element))
                       for p in placements]
            num_blocks = max(_MIN_BLOCKS, min(b // per for b, per in zip(budgets, per_block, strict=True)))
        ray.get([a.allocate.remote(num_blocks, block_size) for a in actors])
        log.info("pipeline of %d stages: %s; %d KV blocks", len(actors), ", ".join(
            f"layers {p.layers[0]}-{p.layers[1]} on {p.node_address}, {p.threads} threads" for p in placements),
                 num_blocks)
        return cls(actors, placements, model_config, num_blocks, block_size, config, traffic, source, node_path)

    # -- the runner seam --------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def max_in_flight(self) -> int:
        return self._max_in_flight

    @max_in_flight.setter
    def max_in_flight(self, n: int) -> None:
        if not 1 <= n <= self.capacity:
            raise ValueError(f"max_in_flight must be between 1 and the pipeline's capacity {self.capacity}")
        self._max_in_flight = n

    def submit(self, plan: StepPlan) -> None:
        """Hands the plan to the stages; returns at once. A transport that broke (a stage
        just died) is reported by ``collect``, as a loss."""
        if len(self._in_flight) >= self.max_in_flight:
            raise RuntimeError(f"{self.max_in_flight} plans are in flight: collect() one first")
        if not self._ready.is_set():
            raise RuntimeError(self._lost_message or "the pipeline is recovering a lost stage")
        ops = () if self.kv_tier is None else self.kv_tier.take_ops()
        payload = pickle.dumps(replace(plan, kv_disk=ops) if ops else plan, protocol=pickle.HIGHEST_PROTOCOL)
        rows = self._rows_payload(plan)
        self._seq += 1
        try:
            handle: Any = self.transport.submit(self._seq, payload, rows)
        except Exception as exc:
            handle = exc
        self.traffic.plan_bytes += len(payload) * len(self.actors) + len(rows or b"")
        with self._lock:  # the watchdog reads the oldest plan's age
            self._in_flight.append((plan, handle, time.monotonic(), self._seq))

    def _rows_payload(self, plan: StepPlan) -> bytes | None:
        """The plan's sampled rows' RowSampling (None for a row the head samples), pickled
        for the last stage; None if it samples none."""
        if self.row_sampling is None:
            return None
        rows = tuple(self.row_sampling(c.request_id) for c in plan.sampled)
        return pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL) if any(r is not None for r in rows) else None

    def collect(self) -> StepResult:
        """Waits for the oldest plan's logits.

        Raises ``KVLost`` if a stage was lost meanwhile (every plan in flight is void;
        the stage is being re-created), or StepFailed naming the plan if a stage failed
        on it while every stage still answers.
        """
        if not self._in_flight:
            raise RuntimeError("no plan was submitted")
        plan, handle, submitted, seq = self._in_flight[0]
        waited = time.perf_counter()
        try:
            logits, tokens, sent_at = self._wait_for(plan, handle, seq, submitted)
        except StepFailed:
            self._done_with_oldest()
            raise
        finally:
            self.collect_wait_s += time.perf_counter() - waited
        self._done_with_oldest()
        self.logits_transfer_s += max(0.0, time.time() - sent_at)
        if logits is None:  # every row's token was picked on the last stage
            logits = torch.empty(0, self.model_config.vocab_size)
        else:  # Ray may hand over a read-only buffer; the sampler may write in place
            logits = torch.from_numpy(logits.copy())
        self.traffic.logits_bytes += logits.numel() * logits.element_size() + 8 * len(tokens or ())
        return StepResult(plan, logits, tokens)

    def _done_with_oldest(self) -> None:
        with self._lock:
            self._in_flight.popleft()

    def open_kv_tier(self, cache: CacheConfig, model_identity: str | os.PathLike[str],
                     on_loaded: Callable[[], object]) -> StageTiers | None:
        """Each stage opens its own disk tier for its layers (``stage_tiers``; ``KVTierHost``)."""
        self.kv_tier = StageTiers.open(self, cache, model_identity, on_loaded)
        return self.kv_tier

    def current_actors(self) -> list[Any]:
        """The stage actors now (the recovery thread replaces a lost one)."""
        with self._lock:
            return list(self.actors)

    def _open_transport(self, strict: bool = True) -> ActorCalls | CompiledGraph:
        """``strict``: at start, a forced graph across nodes is refused; after a recovery
        it falls back to actor calls."""
        return open_transport(self.pipe.transport, self.actors, [p.node_id for p in self.placements],
                              max(p.threads for p in self.placements), self.capacity, self.pipe.step_timeout_s,
                              strict=strict)

    def close(self) -> None:
        """Closes the transport and kills the stage actors (the Ray connection stays, for
        whoever made it)."""
        self._closing.set()
        if self._recovery is not None:
            self._recovery.join(timeout=5)
        self._watchdog.join(timeout=5)
        if self.transport is not None:
            self.transport.close()
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        self._in_flight.clear()

    # -- reporting ----------------------------------------------------------------------
    def stage_counters(self) -> list[StageCounters]:
        return ray.get([a.read_counters.remote() for a in self.actors])

    def _counters_or_none(self, timeout_s: float = 2.0) -> list[StageCounters | None]:
        """Each stage's counters, None for one that does not answer (lost, being re-created)."""
        with self._lock:
            actors = list(self.actors)
        refs = [a.read_counters.remote() for a in actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out: list[StageCounters | None] = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=0))
            except (ray.exceptions.RayError, TimeoutError):
                out.append(None)
        return out

    def reset_counters(self) -> None:
        ray.get([a.reset_counters.remote() for a in self.actors])
        self.collect_wait_s = 0.0
        self.logits_transfer_s = 0.0

    def describe(self) -> RunnerInfo:
        """Stages, layer ranges, nodes, memory, step and transfer times, health and
        recoveries (``GET /v1/cluster`` is formatted from it). A stage that does not
        answer (lost, being re-created) has no ``work``."""
        health = self.health()
        with self._lock:
            placements = list(self.placements)
        stages = tuple(
            StageInfo(p.index, tuple(p.layers), p.node_address, node_id=p.node_id, threads=p.threads,
                      node_memory_bytes=p.node_memory_bytes, restarts=self.recovery.restarts[p.index],
                      work=None if c is None else StageWork(
                          c.weights_from, c.weights_received_bytes, c.plans, c.tokens, c.busy_s, c.wait_s,
                          c.transfer_s, c.idle_fraction, c.hidden_bytes_out))
            for p, c in zip(placements, self._counters_or_none(), strict=True))
        r = self.recovery
        pipeline = PipelineInfo(
            transport=self.transport.kind if self.transport is not None else None, health=health,
            recovery=RecoveryInfo(r.losses, r.recoveries, tuple(r.restarts), tuple(r.recover_seconds)),
            head_traffic=TrafficInfo(**asdict(self.traffic)), logits_transfer_s=self.logits_transfer_s,
            split_reason=self.split_reason, wait_policy=describe_wait_policy())
        return RunnerInfo(self.num_blocks, self.max_in_flight, stages, pipeline)
