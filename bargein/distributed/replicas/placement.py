"""How a replica builds its engine on whatever node Ray puts it: from the node's own copy
of the model file, from weights the head shipped, or as a pipeline of stages.

:class:`ReplicaModel` is the picklable builder a replica actor runs (and runs again when
Ray restarts it, possibly on another node). The head decides once, before any replica
starts, whether shipping is needed: it probes every node that may host a replica for the
same model file at the same path (``~`` is each node's home), and if one lacks it, reads
the whole model *in stored form* (GGUF blocks stay quantized bytes) and puts it in Ray's
object store once. A replica on a node with its own copy reads the file and ignores the
shipped copy; one without fetches it and converts it exactly as a pipeline stage does
(:mod:`bargein.distributed.weights`). Both are counted: bytes put by the head, bytes
received by each replica.

A replica that is a pipeline (``config.pipeline`` set) is the pipeline's head: it runs
on the server's node (which has the file), and its stages go to the nodes the head's
plan gave it (``PipelineConfig.node_ids``), so the N x M stages fit the cluster's CPUs.
The pipeline ships weights to stages on nodes without the file itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from bargein.config import EngineConfig, ModelConfig
from bargein.distributed.engines import pipeline_engine
from bargein.distributed.errors import PipelineSetupError
from bargein.distributed.model_copy import Fingerprint, has_model_copy
from bargein.distributed.replicas.actor import WeightsOrigin
from bargein.distributed.weights import fingerprint, materialize, read_stored
from bargein.engine.block_window import max_positions
from bargein.engine.device import build_model, one_torch_thread, resolve_device, resolve_dtype
from bargein.engine.engine import Engine
from bargein.engine.kv_disk.fingerprint import file_identity, model_files


@dataclass(frozen=True)
class ReplicaModel:
    """A picklable engine builder for a replica (see the module doc)."""

    node_path: str  # the model's path as nodes see it ("~" = each node's home)
    kind: str
    expected: Fingerprint
    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Any
    name: str
    shipped: list[Any] | None = None  # [ObjectRef of StoredWeights]: in a list, so Ray does not fetch it
    prefer_shipped: bool = False  # use the shipped copy even where the node has the file (tests)
    kv_identity: str | None = None  # the head's model files, named for the disk tier of shipped weights

    def build(self) -> tuple[Engine, WeightsOrigin]:
        path = os.path.expanduser(self.node_path)
        if self.config.pipeline is not None:
            return pipeline_engine(self.node_path, self.config), WeightsOrigin("stages")
        own_copy = has_model_copy(path, self.kind, self.expected)
        if own_copy and not (self.prefer_shipped and self.shipped):
            return Engine.from_pretrained(path, self.config, progress=False), WeightsOrigin("file")
        if not self.shipped:
            raise RuntimeError(f"this node has no copy of the model at {self.node_path} and the head shipped none")
        import ray

        stored = ray.get(self.shipped[0])
        config = self.config
        device = resolve_device(config.device)
        max_len = max_positions(config, self.model_config)
        with one_torch_thread():
            weights = materialize(stored, self.model_config, resolve_dtype(config.dtype, device), device)
            model = build_model(self.model_config, weights, config, max_positions=max_len)
        engine = Engine(model, self.tokenizer, config, model_name=self.name, model_identity=self.kv_identity)
        return engine, WeightsOrigin("head", stored.nbytes)


@dataclass
class Shipping:
    """What the head put in the object store for replicas (counted once)."""

    shipped_bytes: int = 0
    nodes_without_file: tuple[str, ...] = ()


def replica_model(ref: str, config: EngineConfig, nodes: list[dict[str, Any]], *,
                  ship: bool | None = None) -> tuple[ReplicaModel, Shipping]:
    """The builder for replicas that may land on any of ``nodes`` (``ray.nodes()`` entries).

    ``ship``: None ships only if a node lacks the file; True ships regardless (and makes
    every replica use the shipped copy); False never ships. A pipeline replica needs no
    shipping here (its stages ship their own).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from bargein.distributed.health import first_line
    from bargein.loader import load_config, load_tokenizer, resolve_model_ref

    source = resolve_model_ref(os.path.expanduser(ref))
    model_config = load_config(source)
    expected = fingerprint(source)
    node_path = ref if ref.startswith("~") else str(source.path)
    shipping = Shipping()
    shipped = None
    if config.pipeline is None and ship is not False:
        probe = ray.remote(num_cpus=0)(has_model_copy)
        lacking = []
        # Every node asked at once: an answer starts a worker process there (a second or more).
        asked = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
            node_path, source.kind, expected) for node in nodes]
        for node, answer in zip(nodes, asked, strict=True):
            try:
                if not ray.get(answer):
                    lacking.append(node["NodeManagerAddress"])
            except ray.exceptions.RayError as exc:
                raise PipelineSetupError(f"node {node['NodeManagerAddress']} did not answer: {first_line(exc)}") \
                    from None
        shipping.nodes_without_file = tuple(lacking)
        if lacking or ship:
            stored = read_stored(source, model_config, (0, model_config.num_layers))
            shipping.shipped_bytes = stored.nbytes
            shipped = [ray.put(stored)]
    # Shipped weights have no file on the replica's node: the disk tier's fingerprint then
    # starts from the head's files' identities (name, size, sampled content digest).
    kv_identity = (repr(tuple(file_identity(f) for f in model_files(source.path)))
                   if config.cache.kv_disk_dir is not None else None)
    model = ReplicaModel(node_path, source.kind, expected, config, model_config, load_tokenizer(source),
                         source.name, shipped, prefer_shipped=bool(ship), kv_identity=kv_identity)
    return model, shipping


def with_own_kv_disk(model: ReplicaModel, index: int) -> ReplicaModel:
    """The same builder with its disk tier (``config.cache.kv_disk_dir``, if set) in a
    subdirectory of its own, ``replica-<index>``: one server owns a tier directory, and a
    replica that Ray restarts (same builder) finds its blocks again."""
    cache = model.config.cache
    if cache.kv_disk_dir is None:
        return model
    cache = replace(cache, kv_disk_dir=os.path.join(cache.kv_disk_dir, f"replica-{index}"))
    return replace(model, config=replace(model.config, cache=cache))


def with_stage_nodes(model: ReplicaModel, node_ids: tuple[str, ...]) -> ReplicaModel:
    """The same builder, for a pipeline replica whose stages go to ``node_ids``."""
    assert model.config.pipeline is not None
    pipeline = replace(model.config.pipeline, node_ids=node_ids)
    return replace(model, config=replace(model.config, pipeline=pipeline))


def plan_stage_nodes(num_replicas: int, num_stages: int, nodes: list[dict[str, Any]],
                     threads_per_stage: int = 1) -> list[tuple[str, ...]]:
    """The Ray node of every stage of every replica: each stage takes ``threads_per_stage``
    CPUs of its node; a replica's stages go to distinct nodes where there are enough,
    the node with the most CPUs left first (ties: more memory). Raises
    PipelineSetupError, in one line, when the N x M stages do not fit the nodes' CPUs."""
    slots = {n["NodeID"]: int(n["Resources"].get("CPU", 0) // threads_per_stage) for n in nodes}
    memory = {n["NodeID"]: n["Resources"].get("memory", 0) for n in nodes}
    needed, offered = num_replicas * num_stages, sum(slots.values())
    if needed > offered:
        raise PipelineSetupError(
            f"{num_replicas} replicas of {num_stages} pipeline stages need {needed * threads_per_stage} CPUs "
            f"({threads_per_stage} per stage), but the cluster's {len(nodes)} nodes offer "
            f"{offered * threads_per_stage}: use fewer replicas or stages, or add nodes")
    plans = []
    for _ in range(num_replicas):
        used: list[str] = []
        for _ in range(num_stages):
            free = [n for n in slots if slots[n] > 0]
            pick = max([n for n in free if n not in used] or free, key=lambda n: (slots[n], memory[n]))
            slots[pick] -= 1
            used.append(pick)
        plans.append(tuple(used))
    return plans
