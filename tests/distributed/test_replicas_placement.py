"""Where replicas run (issue 17): replicas that are pipelines (a replica on a node without
the model file: ``test_shipped_weights.py``).

2 replicas of 2 pipeline stages on 4 one-CPU nodes (the shared cluster and one node the
test adds and removes after): every stage on a node of its own, greedy outputs equal one
engine's, a cancel stops the request on every stage of the replica that runs it (the
stages' plan logs), ``/v1/cluster`` shows the stages; and 2 x 3 stages do not fit,
refused in one line (library and ``bargein serve``, exit 1).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("ray")

import ray  # noqa: E402

from bargein.cli.cluster import format_cluster  # noqa: E402
from bargein.config import CacheConfig, EngineConfig, PipelineConfig, SchedulerConfig  # noqa: E402
from bargein.distributed.errors import PipelineSetupError  # noqa: E402
from bargein.distributed.replicas import ReplicaOptions, ReplicaSet, launch_replicas  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.request import CancelReason, FinishReason  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from bargein.server.app import create_app  # noqa: E402
from bargein.server.settings import ServerSettings  # noqa: E402
from tests.ray_cluster import MB, OBJECT_STORE_MB  # noqa: E402
from tests.tiny_models import TinySpec, tiny_weights, write_gguf  # noqa: E402

SPEC = TinySpec(num_layers=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ENDLESS = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 12)), list(range(20, 26)), list(range(40, 47))]


def _config(pipeline: PipelineConfig | None = None) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=4, num_blocks=48),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                        device="cpu", dtype="float32", pipeline=pipeline)


async def _collect(group: ReplicaSet, prompt, params):
    rid, stream = group.submit(prompt, params)
    tokens = []
    while True:
        out = await group.next_output(stream)
        tokens += out.new_token_ids
        if out.finished:
            return rid, tokens, out


def test_replicas_that_are_pipelines(ray_cluster, tmp_path, capsys):
    path = str(write_gguf(tmp_path / "tiny.gguf", SPEC, tiny_weights(SPEC)))
    extra = ray_cluster.add_node(num_cpus=1, memory=300 * MB, object_store_memory=OBJECT_STORE_MB * MB)
    ray_cluster.wait_for_nodes()
    group = None
    try:
        pipeline = PipelineConfig(stages=2, ray_address=ray_cluster.address)
        # 2 x 3 stages need 6 CPUs; the cluster has 4: refused before anything starts.
        with pytest.raises(PipelineSetupError, match="2 replicas of 3 pipeline stages need 6 CPUs"):
            launch_replicas(path, _config(PipelineConfig(stages=3, ray_address=ray_cluster.address)),
                            ray_cluster.address, 2)
        from bargein.cli import main

        assert main(["serve", "--port", "0", "--model", path, "--ray", ray_cluster.address, "--replicas", "2",
                     "--pipeline-stages", "3"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("bargein: error: 2 replicas of 3 pipeline stages need 6 CPUs")

        group = launch_replicas(path, _config(pipeline), ray_cluster.address, 2,
                                ReplicaOptions(call_timeout_s=10.0))
        local = Engine.from_pretrained(path, _config(), progress=False)
        expected = [list(o.token_ids) for o in local.generate(PROMPTS, GREEDY)]

        async def main_():
            results = await asyncio.gather(*(_collect(group, p, GREEDY) for p in PROMPTS))
            rid, stream = group.submit([9, 9, 8, 8, 7, 7], ENDLESS)
            owner = group.records.live[rid].replica
            out = await group.next_output(stream)
            group.abort(rid, CancelReason.USER)
            while not out.finished:
                out = await group.next_output(stream)
            app = create_app(group, ServerSettings())
            app.state.ctx.loop = asyncio.get_running_loop()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                cluster = (await client.get("/v1/cluster")).json()
            return results, rid, owner, out, cluster

        results, rid, owner, cancelled, cluster = asyncio.run(main_())
        assert [tokens for _, tokens, _ in results] == expected
        assert cancelled.finish_reason == FinishReason.CANCELLED and len(cancelled.token_ids) < 100

        # The cancel reached every stage of the replica that ran it: each stage executed
        # exactly the same plans with it, and no plan after the cancel holds it.
        steps = ray.get(group.actors[owner].stage_steps_with.remote(rid))
        assert len(steps) == 2 and steps[0] and steps[0] == steps[1]
        asyncio.run(_collect(group, [9, 9, 8, 8, 7, 7, 1], GREEDY))  # more work on the same replica
        assert ray.get(group.actors[owner].stage_steps_with.remote(rid)) == steps
        assert ray.get(group.actors[1 - owner].stage_steps_with.remote(rid)) == [[], []]

        assert cluster["stages_per_replica"] == 2 and cluster["num_replicas"] == 2
        stages = [s for r in cluster["replicas"] for s in r["stages"]]
        assert len(stages) == 4 and len({s["node_id"] for s in stages}) == 4  # N x M stages, a node each
        assert all(s["state"] == "ok" and s["weights_from"] == "file" for s in stages)
        assert all(r["weights_from"] == "stages" for r in cluster["replicas"])
        text = format_cluster(cluster)
        assert "replica 0 stage 1: layers" in text and "replica 1 stage 0: layers" in text
        asyncio.run(group.check_block_accounting())
    finally:
        if group is not None:
            group.close()
        ray_cluster.remove_node(extra)

