"""The KV disk tier on a pipeline (issue 27 item 5): each stage keeps its own layers'
blocks in its own directory, and a conversation survives a restart of the pipeline and
of one stage, token for token.

Two stages over a 4-layer GGUF on the shared simulated cluster (``tests/ray_cluster.py``);
every answer is compared with a single-process engine without the tier. The scenario:

1. A pipeline answers a conversation's turn and shuts down: every stage wrote the same
   blocks (the conversation's full computed blocks), each in its own directory, under
   its own fingerprint (the file names differ, the keys do not).
2. A new pipeline over the same directory (a restart) continues the conversation from
   its tokens (as ``Conversation.load`` does): every one of those blocks is read back from
   the two stages' tiers (``cached_tokens`` counts them, exactly), the answer is the
   reference's, and the block accounting is clean.
   Then blocks evicted while it runs (a one-shot prompt's cached blocks, pushed out by a
   longer prompt in a small pool) are written by every stage (the spills ride the
   plans) and read back for the same prompt again: all of its full blocks hit, the
   answer is the reference's.
3. One stage's process is killed (SIGKILL, right after a prompt whose evicted blocks its
   writer is writing) and re-created (its tier re-opened from its directory, where one
   block's file was removed meanwhile): every file left is whole, what the kill left
   mid-write is gone, and the next turn reads back only the blocks that
   every stage has (the ones before the removed one: a block is used only if all stages
   hold it) and recomputes the rest, with the reference's answer.
4. Closing the conversation deletes its blocks' files in every stage's directory (the
   deletion rides to the stages while the pipeline is idle).
5. The cancellation contract's harness (``tests/engine/contract_harness.py``: cancel,
   continue, fork, rewind, close, a prefix hit; C3, C4, C5, C7) on the same pipeline,
   with every stage's tier on, after the recovery: answers equal a process without a
   prefix cache, token for token; only new tokens are computed; accounting clean.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from bargein.build import build_engine  # noqa: E402
from bargein.config import CacheConfig, EngineConfig, PipelineConfig, SchedulerConfig  # noqa: E402
from bargein.distributed.stage_tiers import StageTiers  # noqa: E402
from bargein.engine.disk_cache import chain_keys  # noqa: E402
from bargein.engine.engine import Engine  # noqa: E402
from bargein.engine.kv_disk.block_file import (  # noqa: E402
    SUFFIX,
    TMP_PREFIX,
    decode,
    header_fingerprint,
    parse_name,
)
from bargein.engine.outputs import OutputCollector  # noqa: E402
from bargein.engine.sampling import SamplingParams  # noqa: E402
from tests.engine.contract_harness import GREEDY as CONTRACT_GREEDY  # noqa: E402
from tests.engine.contract_harness import Turns, check_cancel_continue_fork_rewind  # noqa: E402
from tests.tiny_models import TinySpec, tiny_weights, write_gguf  # noqa: E402

SPEC = TinySpec(num_layers=4)
BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [(i * 37) % 200 + 3 for i in range(13)]
FOLLOW_UPS = ([11, 12, 13], [21, 22], [31, 32, 33, 34])
ONE_SHOT = [(i * 53) % 200 + 7 for i in range(41)]  # 10 full blocks and the token sampled from
PUSHES_OUT = [(i * 71) % 200 + 3 for i in range(64)]
PUSHES_OUT_AGAIN = [(i * 89) % 200 + 5 for i in range(64)]
POOL_BLOCKS = 32  # the pipeline's: the one-shot prompt's blocks are evicted by the 64-token one


def _config(kv_disk: Path | None = None, pipeline: bool = True) -> EngineConfig:
    """Generous heartbeats: only the killed stage may count as lost, however loaded the machine."""
    return EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=POOL_BLOCKS if pipeline else 64, kv_disk_dir=None if kv_disk is None else str(kv_disk)),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32), device="cpu", dtype="float32",
        pipeline=PipelineConfig(stages=2, heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0, step_timeout_s=60.0)
        if pipeline else None)


def turn(engine: Engine, conversation: str | None, tokens: list[int], timeout_s: float = 120.0
         ) -> tuple[list[int], int]:
    """One greedy turn on the conversation (None: a prompt of its own): (answer tokens, cached tokens)."""
    collector = OutputCollector(engine)
    rid = collector.add_request(tokens, GREEDY, conversation_id=conversation)
    ends = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < ends, "the engine stopped making progress"
        for out in collector.step():
            if out.request_id == rid and out.finished:
                assert out.error is None, out.error
                return list(out.token_ids), out.usage.cached_tokens


def stage_files(directory: Path) -> dict[bytes, str]:
    """A stage directory's block files: key -> the fingerprint in its name."""
    return dict(parse_name(p.name) for p in directory.glob(f"*{SUFFIX}"))  # type: ignore[misc]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_gguf(tmp_path_factory.mktemp("pipeline-kv-disk") / "tiny.gguf", SPEC, tiny_weights(SPEC)))


@pytest.fixture(scope="module")
def reference(model: str) -> list[list[int]]:
    """The three turns' answers, then the one-shot prompt's, from one process without the tier."""
    local = Engine.from_pretrained(model, _config(pipeline=False), progress=False)
    conversation = local.open_conversation(PROMPT)
    return [turn(local, conversation, f)[0] for f in FOLLOW_UPS] + [turn(local, None, ONE_SHOT)[0]]


def test_a_restarted_pipeline_and_a_restarted_stage_continue_from_each_stages_own_tier(
        ray_cluster, model: str, reference: list[list[int]], tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    # 1. One turn, then shutdown: every stage writes the conversation's blocks.
    first = build_engine(model, _config(kv), progress=False)
    try:
        layers = [p.layers for p in first.runner.placements]
        conversation = first.open_conversation(PROMPT)
        answer, _ = turn(first, conversation, FOLLOW_UPS[0])
        assert answer == reference[0]
        tokens = first.conversation_tokens(conversation)
    finally:
        first.close()
    assert len(layers) == 2 and layers[0][0] == 0 and layers[0][1] == layers[1][0] and layers[1][1] == SPEC.num_layers
    directories = [kv / f"stage-{start}-{end}" for start, end in layers]
    files = [stage_files(d) for d in directories]
    written = (len(tokens) - 1) // BLOCK  # every full block of computed tokens (the last has no K/V yet)
    assert len(files[0]) == written and files[0].keys() == files[1].keys()
    assert len({short for f in files for short in f.values()}) == 2  # one fingerprint per layer range
    assert all(d.stat().st_mode & 0o777 == 0o700 for d in directories)
    assert all(p.stat().st_mode & 0o777 == 0o600 for d in directories for p in d.glob(f"*{SUFFIX}"))

    # 2. A restart: the conversation, reopened from its tokens, is read back from both stages.
    second = build_engine(model, _config(kv), progress=False)
    try:
        assert second.disk is not None and second.disk.tier.rebuild.blocks == written
        conversation = second.open_conversation(tokens)
        answer, cached = turn(second, conversation, FOLLOW_UPS[1])
        assert answer == reference[1] and cached == written * BLOCK
        assert second.disk.stats().hits == written and second.disk.loaded_blocks == written
        second.check_block_accounting()

        # 2b. Blocks evicted mid-run: every stage writes them (the spills ride the plans) and reads them back.
        assert turn(second, None, ONE_SHOT) == (reference[3], 0)
        turn(second, None, PUSHES_OUT)
        tiers = second.disk.tier
        assert isinstance(tiers, StageTiers)
        ends = time.monotonic() + 60
        while any(s is None or s.queued_writes for s in tiers.stage_stats()):
            assert time.monotonic() < ends, "the stages' writers did not drain"
            time.sleep(0.05)
        hits = tiers.hits
        assert turn(second, None, ONE_SHOT) == (reference[3], len(ONE_SHOT) - 1)  # every full block
        assert tiers.hits > hits  # some of them came from disk: they had been evicted
        second.check_block_accounting()

        # 3. Stage 1's process is killed (SIGKILL) right after a prompt whose evictions its
        # writer is writing, and re-created; its directory lost block 1's file meanwhile.
        runner = second.runner
        key = chain_keys(tokens, BLOCK)[1]  # the conversation's second block
        (directories[1] / f"{key.hex()}.{files[1][key]}{SUFFIX}").unlink()
        turn(second, None, PUSHES_OUT_AGAIN)  # evicts PUSHES_OUT's blocks: the stages write them
        _, pid = ray.get(runner.actors[1].ping.remote())
        os.kill(pid, signal.SIGKILL)
        probe = second.open_conversation([5, 6, 7])  # its turn finds the loss and waits out the recovery
        turn(second, probe, [8])
        second.close_conversation(probe)
        assert runner.recovery.restarts == [0, 1] and second.runner_health().state == "ok"
        assert not list(directories[1].glob(f"{TMP_PREFIX}*"))  # the re-created stage removed what the kill left
        for d in directories:  # whole files only
            for path in d.glob(f"*{SUFFIX}"):
                data = path.read_bytes()
                decode(data, key=parse_name(path.name)[0], fingerprint=header_fingerprint(data) or b"")
        answer, cached = turn(second, conversation, FOLLOW_UPS[2])
        assert answer == reference[2] and cached == 1 * BLOCK  # block 0 alone is on both stages
        second.check_block_accounting()

        # 4. Closing the conversation deletes its blocks' files on every stage.
        keys = set(chain_keys(second.conversation_tokens(conversation), BLOCK))
        on_disk = [keys & stage_files(d).keys() for d in directories]
        assert len(on_disk[0]) >= written and len(on_disk[1]) >= written - 1  # block 1's file went on stage 1
        second.close_conversation(conversation)
        ends = time.monotonic() + 60
        while any(keys & stage_files(d).keys() for d in directories):
            assert time.monotonic() < ends, "a stage kept a closed conversation's files"
            time.sleep(0.05)

        # 5. The contract (C3, C4, C5, C7) with every stage's tier on, after the recovery.
        check_cancel_continue_fork_rewind(PipelineHarness(second, model), "tiny", "exact",
                                          Turns(prompt_len=13, seed_offset=13, rewind_back=7))
    finally:
        second.close()


class PipelineHarness:
    """The contract harness's two engines for one pipeline: the pipeline itself (with the
    prefix cache and the tier) and, for the references, one process without a prefix cache."""

    def __init__(self, pipeline: Engine, model: str):
        self.pipeline = pipeline
        config = _config(pipeline=False)
        self.local = Engine.from_pretrained(model, replace(config, cache=replace(config.cache, enable_prefix_caching=False)),
                                            progress=False)

    def engine(self, name: str, precision: str, prefix_caching: bool) -> Engine:
        assert prefix_caching and precision == "exact"  # the pipeline's: float32, exact
        return self.pipeline

    def no_cancel(self, name: str, precision: str, prompt: list[int]) -> list[int]:
        (out,) = self.local.generate([prompt], CONTRACT_GREEDY)
        return list(out.token_ids)

