"""A node without the model file gets its stage's weights from the head (issue 12).

The model is given as ``~/models/tiny.gguf``: each node looks it up in its own home
directory, as on a home cluster where the machines' users differ. The test's head and
one added node have the file there; another added node's home is empty, so that node
truly lacks it: its stage is built from the tensors the head shipped (in stored form),
and those are the only weight bytes that pass through the head.
"""

from __future__ import annotations

import uuid

import pytest
import torch

pytest.importorskip("ray")

from bargein.config import CacheConfig, EngineConfig, PipelineConfig, SchedulerConfig  # noqa: E402
from bargein.distributed.split import stage_weight_bytes  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from tests.ray_cluster import MB, OBJECT_STORE_MB  # noqa: E402
from tests.tiny_models import TinySpec, tiny_weights, write_gguf  # noqa: E402

SPEC = TinySpec(num_layers=4)


def _config(resource: str | None = None) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                        device="cpu", dtype="float32",
                        pipeline=None if resource is None else PipelineConfig(stages=2, node_resource=resource))


def test_a_node_without_the_model_file_gets_its_layers_from_the_head(ray_cluster, tmp_path, monkeypatch) -> None:
    with_file, without_file = tmp_path / "home-a", tmp_path / "home-b"
    for home in (with_file, without_file):
        (home / "models").mkdir(parents=True)
    path = write_gguf(with_file / "models" / "tiny.gguf", SPEC, tiny_weights(SPEC))
    monkeypatch.setenv("HOME", str(with_file))  # the head's home
    resource = f"weights-{uuid.uuid4().hex[:8]}"
    added = {home: ray_cluster.add_node(num_cpus=1, memory=300 * MB, object_store_memory=OBJECT_STORE_MB * MB,
                                        resources={resource: 1}, env_vars={"HOME": str(home)})
             for home in (with_file, without_file)}
    ray_cluster.wait_for_nodes()
    pipe = None
    try:
        pipe = Engine.from_pretrained("~/models/tiny.gguf", _config(resource), progress=False)
        runner = pipe.runner
        lacking = added[without_file].node_id
        counters = runner.stage_counters()
        assert {c.node_id for c in counters} == {n.node_id for n in added.values()}
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
        for node in added.values():
            ray_cluster.remove_node(node, allow_graceful=False)
