"""A node without the model file gets its stage's weights from the head (issue 12).

The model is given as ``~/models/tiny.gguf``: each node looks it up in its own home
directory, as on a home cluster where the machines' users differ. The test's head and
one added node have the file there; another added node's home is empty, so that node
truly lacks it: its stage is built from the tensors the head shipped (in stored form),
and those are the only weight bytes that pass through the head.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ray")

from bargein.build import build_engine  # noqa: E402
from bargein.config import CacheConfig, EngineConfig, PipelineConfig, SchedulerConfig  # noqa: E402
from bargein.distributed.split import stage_weight_bytes  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from tests.ray_cluster import add_nodes_with_and_without_the_file  # noqa: E402
from tests.tiny_models import TinySpec, tiny_weights, write_gguf  # noqa: E402

SPEC = TinySpec(num_layers=4)


def _config(resource: str | None = None) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                        device="cpu", dtype="float32",
                        pipeline=None if resource is None else PipelineConfig(stages=2, node_resource=resource))


def test_a_node_without_the_model_file_gets_its_layers_from_the_head(ray_cluster, tmp_path, monkeypatch) -> None:
    homes = add_nodes_with_and_without_the_file(ray_cluster, tmp_path, monkeypatch,
                                                lambda p: write_gguf(p, SPEC, tiny_weights(SPEC)), "weights")
    path, resource = homes.path, homes.resource
    pipe = None
    try:
        pipe = build_engine("~/models/tiny.gguf", _config(resource), progress=False)
        runner = pipe.runner
        lacking = homes.without_file.node_id
        counters = runner.stage_counters()
        assert {c.node_id for c in counters} == {n.node_id for n in homes.nodes}
        assert [c.weights_from for c in counters] == ["head" if c.node_id == lacking else "file" for c in counters]
        shipped = next(p for p in runner.placements if p.node_id == lacking)
        stored = stage_weight_bytes(pipe.model_config, shipped.layers, 4)  # an F32 file: stored as loaded
        assert runner.traffic.weights_shipped_bytes == stored
        assert [c.weights_received_bytes for c in counters] == [stored if c.node_id == lacking else 0
                                                                 for c in counters]

        local = Engine.from_pretrained(str(path), _config(), progress=False)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        prompts = [torch.arange(3, 12).tolist(), torch.arange(20, 26).tolist()]
        plans_before = runner.traffic.plan_bytes
        assert [o.token_ids for o in pipe.generate(prompts, params)] == \
               [o.token_ids for o in local.generate(prompts, params)]
        assert runner.traffic.weights_shipped_bytes == stored  # generating ships no more weights
        assert runner.traffic.plan_bytes > plans_before
    finally:
        if pipe is not None:
            pipe.close()
        for node in homes.nodes:
            ray_cluster.remove_node(node, allow_graceful=False)
