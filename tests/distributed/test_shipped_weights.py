"""A node without the model file gets its weights from the head: a pipeline stage's
(issue 12) and a whole replica's (issue 17).

The model is given as ``~/models/tiny.gguf``: each node looks it up in its own home
directory, as on a home cluster where the machines' users differ. The module adds two
nodes to the shared cluster (``tests/ray_cluster.py``), once for both tests: one's home
has the file, the other's is empty, so that node truly lacks it. What it runs is built
from the tensors the head shipped in stored form, and those are the only weight bytes
that pass through the head (counted: put once, received once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("ray")

from bargein.build import build_engine  # noqa: E402
from bargein.config import CacheConfig, EngineConfig, PipelineConfig, SchedulerConfig  # noqa: E402
from bargein.distributed.replicas import ReplicaOptions, ReplicaSet, launch_replicas  # noqa: E402
from bargein.distributed.split import stage_weight_bytes  # noqa: E402
from bargein.distributed.weights import read_stored  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from bargein.loader import load_config, resolve_model_ref  # noqa: E402
from bargein.server.cluster import cluster_snapshot  # noqa: E402
from tests.ray_cluster import TwoHomes, nodes_with_and_without_the_file  # noqa: E402
from tests.tiny_models import TinySpec, tiny_weights, write_gguf  # noqa: E402

SPEC = TinySpec(num_layers=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 12)), list(range(20, 26)), list(range(40, 47))]


def _config(pipeline: PipelineConfig | None = None, num_blocks: int = 48) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                        device="cpu", dtype="float32", pipeline=pipeline)


@pytest.fixture(scope="module")
def homes(ray_cluster, tmp_path_factory) -> Iterator[TwoHomes]:
    with nodes_with_and_without_the_file(ray_cluster, tmp_path_factory.mktemp("homes"), "weights") as added:
        yield added


def test_a_node_without_the_model_file_gets_its_layers_from_the_head(homes: TwoHomes, monkeypatch) -> None:
    homes.enter(monkeypatch)
    path = homes.write(lambda p: write_gguf(p, SPEC, tiny_weights(SPEC)))
    pipe = None
    try:
        pipe = build_engine("~/models/tiny.gguf", _config(PipelineConfig(stages=2, node_resource=homes.resource), 32),
                            progress=False)
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

        local = Engine.from_pretrained(str(path), _config(num_blocks=32), progress=False)
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


async def _collect(group: ReplicaSet, prompt, params):
    rid, stream = group.submit(prompt, params)
    tokens = []
    while True:
        out = await group.next_output(stream)
        tokens += out.new_token_ids
        if out.finished:
            return rid, tokens, out


def test_a_replica_on_a_node_without_the_model_file_gets_the_weights_from_the_head(homes: TwoHomes,
                                                                                     ray_cluster, monkeypatch):
    homes.enter(monkeypatch)
    path = homes.write(lambda p: write_gguf(p, SPEC, tiny_weights(SPEC), tensor_type="Q8_0"))
    group = None
    try:
        group = launch_replicas("~/models/tiny.gguf", _config(), ray_cluster.address, 2,
                                ReplicaOptions(resources={homes.resource: 1}, call_timeout_s=10.0))
        source = resolve_model_ref(str(path))
        model_config = load_config(source)
        stored = read_stored(source, model_config, (0, model_config.num_layers)).nbytes
        assert stored < stage_weight_bytes(model_config, (0, model_config.num_layers), 4) / 3  # Q8_0 bytes
        infos = group.replica_infos()
        lacking = homes.without_file.node_id
        assert {i.node_id for i in infos.values()} == {n.node_id for n in homes.nodes}
        assert {i.node_id: (i.weights_from, i.weights_received_bytes) for i in infos.values()} == {
            homes.with_file.node_id: ("file", 0), lacking: ("head", stored)}
        assert group.weights_shipped_bytes == stored and len(group.nodes_without_file) == 1

        local = Engine.from_pretrained(str(path), _config(), progress=False)
        expected = [list(o.token_ids) for o in local.generate(PROMPTS, GREEDY)]

        async def main_():
            return await asyncio.gather(*(_collect(group, p, GREEDY) for p in PROMPTS))

        results = asyncio.run(main_())
        assert [tokens for _, tokens, _ in results] == expected
        assert all(r["routed"] > 0 for r in group.router.snapshot())  # both replicas answered
        assert cluster_snapshot(group)["weights_shipped_bytes"] == stored
        asyncio.run(group.check_block_accounting())
    finally:
        if group is not None:
            group.close()
