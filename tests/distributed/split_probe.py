"""Run on a namespace host (``python -m tests.distributed.split_probe ADDRESS MODEL``):
connects to the Ray cluster at ADDRESS and prints, as one JSON line, the automatic layer
split of a 2-stage pipeline of MODEL (``pipeline.place_stages``, every node measured
afresh), the split by memory alone, and each node's speed as a second, cached look-up
answers it, and what the router would make of those rates for replicas on these nodes
(their routing weights, and where 16 new chats at once would go). No stage is
started: the test sees the split a server would use without loading one."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

from bargein.config import EngineConfig, PipelineConfig
from bargein.distributed.calibrate import LayerShapes, measure_nodes
from bargein.distributed.connect import connect
from bargein.distributed.pipeline import place_stages
from bargein.distributed.router import Router
from bargein.distributed.split import head_layers, split_by_memory
from bargein.distributed.widths import stage_widths
from bargein.loader import load_config, resolve_model_ref


def main(address: str, model: str) -> None:
    source = resolve_model_ref(os.path.expanduser(model))
    model_config = load_config(source)
    config = EngineConfig(pipeline=PipelineConfig(stages=2, ray_address=address))
    connect(address, 2)
    widths = stage_widths(source, model_config, config)
    placements, reason = place_stages(2, model_config, config, None, widths, recalibrate=True)
    memory_only = split_by_memory(model_config.num_layers, [p.node_memory_bytes for p in placements],
                                  head_layers(model_config, widths))
    speeds = measure_nodes({p.node_id: p.node_address for p in placements}, {p.node_id: p.threads for p in placements},
                           LayerShapes.of(model_config))
    router = Router(len(placements), 16)
    router.set_speeds([speeds[p.node_id].layers_per_s for p in placements])
    routed = Counter(router.choose(list(range(100 + n, 140 + n))).replica for n in range(16))
    print(json.dumps({"layers": [list(p.layers) for p in placements],
                      "routing_weights": [r["speed"] for r in router.snapshot()],
                      "routed": [routed[i] for i in range(len(placements))],
                      "addresses": [p.node_address for p in placements], "reason": reason,
                      "memory_only": [list(r) for r in memory_only],
                      "cached": {p.node_address: speeds[p.node_id].cached for p in placements},
                      "cpus": {p.node_address: speeds[p.node_id].cpus for p in placements}}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
