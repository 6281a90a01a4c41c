"""Starting a replica set: Ray connected, the replica actors placed and loaded, all or nothing.

Whole-model replicas go where Ray finds a CPU (``options.resources`` narrows it); a node
without the model file gets the weights the head shipped (see
:mod:`~bargein.distributed.replicas.placement`). With ``config.pipeline`` set, each
replica is a pipeline: its head on this node, its stages on the nodes planned for it so
that all N x M stages fit (PipelineSetupError, one line, when they do not).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.node_cpus import measure_usable_cpus
from bargein.distributed.replicas.actor import EngineBuilder, ReplicaWorker, kill
from bargein.distributed.replicas.facade import ReplicaSet
from bargein.distributed.replicas.options import ReplicaOptions
from bargein.distributed.replicas.slots import ReplicaSlot, plan_replica_slots
from bargein.distributed.replicas.speeds import weigh_by_speed
from bargein.distributed.worker_env import worker_runtime_env

try:
    import ray
except ModuleNotFoundError as exc:  # the optional extra is missing: start_replicas says so in one line
    if exc.name != "ray" and not (exc.name or "").startswith("ray."):
        raise
    ray = None

log = logging.getLogger("bargein.distributed")


def start_replicas(build: EngineBuilder | Sequence[EngineBuilder], num_replicas: int,
                   options: ReplicaOptions | None = None, slots: Sequence[ReplicaSlot] | None = None) -> ReplicaSet:
    """Starts ``num_replicas`` actors (Ray must be connected) and waits until all have loaded.

    ``build``: one builder for every replica, or one per replica (pipelines whose stages
    go to different nodes). ``slots``: each replica's node (preferred: Ray may restart it
    elsewhere), threads and CPUs; default ``options.threads`` and ``options.num_cpus``
    wherever Ray finds room. All or nothing: on any failure the actors started (and, owned
    by them, their stages) are killed and PipelineSetupError says why in one line.
    """
    options = options or ReplicaOptions()
    if ray is None:
        raise PipelineSetupError("Ray is not installed: pip install 'bargein[ray]'")
    if num_replicas < 1:
        raise PipelineSetupError("--replicas must be at least 1")
    builds = list(build) if isinstance(build, Sequence) else [build] * num_replicas
    if len(builds) != num_replicas:
        raise ValueError(f"{len(builds)} builders were given for {num_replicas} replicas")
    slots = list(slots or [ReplicaSlot(None, options.threads or 1, options.num_cpus)] * num_replicas)
    cpus, needed = ray.cluster_resources().get("CPU", 0), sum(slot.num_cpus for slot in slots)
    if needed > cpus:
        each = {slot.num_cpus for slot in slots}
        raise PipelineSetupError(f"{num_replicas} replicas need {needed:g} CPUs"
                                 + (f" ({each.pop():g} each)" if len(each) == 1 else "")
                                 + f", but the cluster has {cpus:g}")
    placement: dict[str, Any] = {}
    if options.resources:
        placement["resources"] = dict(options.resources)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if options.on_head_node:
        placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)
    # The head's OpenMP wait policy goes with every replica (see worker_env): its node's
    # raylet may have been started without it.
    actor_class = ray.remote(num_cpus=options.num_cpus, max_restarts=options.max_restarts,
                             max_task_retries=0, max_concurrency=64, **placement,
                             **worker_runtime_env())(ReplicaWorker)
    # The builders wait in a named store on this node and each replica fetches its own by
    # the store's name: a constructor argument that is (or holds) an object reference
    # makes Ray log, for an actor that may restart, an error that its restart will fail,
    # and a shipped model is such a reference. The replica set holds the store, so a
    # restarted replica finds its builder there.
    store_name = f"bargein-builders-{uuid.uuid4().hex[:12]}"
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    store = ray.remote(num_cpus=0, max_restarts=0)(BuilderStore).options(
        name=store_name, scheduling_strategy=here).remote(builds)
    actors = [actor_class.options(**_slot_options(slot)).remote(i, store_name, slot.threads)
              for i, slot in enumerate(slots)]
    try:
        pings = [a.ping.remote() for a in actors]
        ready, _ = ray.wait(pings, num_returns=num_replicas, timeout=options.start_timeout_s)
        if len(ready) < num_replicas:
            raise PipelineSetupError(f"only {len(ready)} of {num_replicas} replicas started within "
                                     f"{options.start_timeout_s:.0f} s (too few CPUs or too little memory "
                                     f"on the cluster?)")
        started = ray.get(pings)
        facts = ray.get(actors[0].describe.remote())
    except PipelineSetupError:
        kill([*actors, store])
        raise
    except Exception as exc:
        kill([*actors, store])
        raise PipelineSetupError(f"a replica failed to start: {_cause(exc)}") from None
    group = ReplicaSet(actors, facts, options, started)
    group.builder_store = store
    return group


def _slot_options(slot: ReplicaSlot) -> dict[str, Any]:
    """A replica's own actor options: its CPUs, and its node as a preference (a replica Ray
    restarts after its node is lost goes where there is room)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {"num_cpus": slot.num_cpus}
    if slot.node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(slot.node_id, soft=True)
    return options


class BuilderStore:
    """Holds every replica's builder (a Ray actor on the server's node, for the replica set's life)."""

    def __init__(self, builds: list[EngineBuilder]):
        self.builds = builds

    def get(self, index: int) -> EngineBuilder:
        return self.builds[index]


def launch_replicas(ref: str, config: Any, address: str, num_replicas: int,
                    options: ReplicaOptions | None = None, *, ship: bool | None = None) -> ReplicaSet:
    """Connects to Ray and starts ``num_replicas`` replicas of the model at ``ref`` (see the module doc)."""
    from bargein.distributed.pipeline import connect
    from bargein.distributed.replicas.placement import (
        plan_stage_nodes,
        replica_model,
        with_own_kv_disk,
        with_stage_nodes,
    )

    options = options or ReplicaOptions()
    pipe = config.pipeline
    if pipe is not None and pipe.threads_per_stage is None:  # planned per replica set: a thread a stage
        config = replace(config, pipeline=(pipe := replace(pipe, threads_per_stage=1)))
    connect(address, num_replicas * (pipe.stages if pipe else 1))
    wanted = dict(options.resources or {})
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0
             and all(n["Resources"].get(k, 0) >= v for k, v in wanted.items())]
    if not nodes:
        raise PipelineSetupError("the Ray cluster has no live node with a CPU" +
                                 (f" offering {', '.join(wanted)}" if wanted else ""))
    builds: EngineBuilder | list[EngineBuilder]
    slots: list[ReplicaSlot] | None = None
    if pipe is not None:
        stage_nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0
                       and (pipe.node_resource is None or n["Resources"].get(pipe.node_resource, 0) > 0)]
        plans = plan_stage_nodes(num_replicas, pipe.stages, stage_nodes, pipe.threads_per_stage)
        model, shipping = replica_model(ref, config, nodes)
        builds = [with_stage_nodes(model, plan) for plan in plans]
        options = replace(options, num_cpus=0, threads=1, on_head_node=True, stages_per_replica=pipe.stages)
    else:
        model, shipping = replica_model(ref, config, nodes, ship=ship)
        builds = model if config.cache.kv_disk_dir is None else [model] * num_replicas
        if options.threads is None:  # per node: what each offers, shared among its replicas
            slots = plan_replica_slots(num_replicas, nodes, measure_usable_cpus(n["NodeID"] for n in nodes))
            for i, slot in enumerate(slots):
                log.info("replica %d: node %s, %d compute threads", i, slot.node_id, slot.threads)
    if config.cache.kv_disk_dir is not None:  # one tier directory per replica
        builds = [with_own_kv_disk(b, i) for i, b in enumerate(builds)]
    group = start_replicas(builds, num_replicas, options, slots)
    if pipe is None:  # whole-model replicas: the router weighs each by its node's measured speed
        weigh_by_speed(group)
    group.builds = builds  # holds the shipped weights' reference: a restarted replica fetches them again
    group.weights_shipped_bytes = shipping.shipped_bytes
    group.nodes_without_file = shipping.nodes_without_file
    return group


def _cause(exc: BaseException) -> str:
    """The last line of a replica's failure that says something (Ray wraps the cause)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__

