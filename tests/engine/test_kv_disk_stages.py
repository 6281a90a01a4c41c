"""Pipeline stages' own tiers, as units: each stage's fingerprint names its layer range
(and so differs from another stage's and from the whole model's), each has its own
directory, a stage's block round-trips through its tier bit for bit, and a block file
another stage wrote is refused (the actors use them: tests/distributed/test_pipeline_kv_disk.py). Tiny
random-weight model, CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from bargein.config import CacheConfig, EngineConfig
from bargein.engine.block_keys import chain_hash
from bargein.engine.device import build_model
from bargein.engine.disk_cache import stage_fingerprint, stage_tier_directory
from bargein.engine.kv_disk.block_file import BlockRecord, Skipped, file_name, read_block
from bargein.engine.kv_disk.payload import extract_block, write_block
from bargein.engine.kv_disk.tier import DiskTier
from tests.tiny_engine import TINY, tiny_weights

BLOCK = 4
CONFIG = EngineConfig(cache=CacheConfig(block_size=BLOCK, num_blocks=8), device="cpu", dtype="float32",
                      cuda_graphs=False)


def stage(layers: tuple[int, int]):
    return build_model(TINY, dict(tiny_weights(0)), CONFIG, max_positions=TINY.max_position_embeddings,
                       layer_range=layers)


def test_each_stage_has_its_own_fingerprint_and_directory(tmp_path: Path) -> None:
    first, second, whole = stage((0, 1)), stage((1, 2)), stage((0, 2))
    fps = [stage_fingerprint([s], BLOCK, "tiny-seed-0") for s in (first, second, whole)]
    assert [fp.layer_range for fp in fps] == [(0, 1), (1, 2), (0, 2)]
    assert len({fp.digest for fp in fps}) == 3 and len({fp.short for fp in fps}) == 3
    assert len({fp.files_digest for fp in fps}) == 1  # one model
    assert stage_fingerprint([first, second], BLOCK, "tiny-seed-0").digest == fps[2].digest  # both stages: all layers
    assert stage_tier_directory(tmp_path, (0, 1)) == tmp_path / "stage-0-1"
    assert stage_tier_directory(tmp_path, (1, 2)) != stage_tier_directory(tmp_path, (0, 1))


def test_a_stage_reads_back_its_own_blocks_and_refuses_another_stages(tmp_path: Path) -> None:
    stages = [stage((0, 1)), stage((1, 2))]
    tokens = (5, 6, 7, 8)
    key = chain_hash(None, tokens)
    tiers, payloads = [], []
    g = torch.Generator().manual_seed(3)
    for s in stages:
        caches = [(c.k, c.v) for c in s.make_kv_caches(8, BLOCK)]
        for k, v in caches:
            k.copy_(torch.randn(k.shape, generator=g))
            v.copy_(torch.randn(v.shape, generator=g))
        fp = stage_fingerprint([s], BLOCK, "tiny-seed-0")
        tier = DiskTier(stage_tier_directory(tmp_path, (s.start, s.end)), fp, 1 << 20)
        payloads.append(extract_block(caches, 2))
        assert tier.spill(BlockRecord(key, None, tokens, payloads[-1]))
        assert tier.flush(10)
        tiers.append((tier, caches))
    assert payloads[0] != payloads[1]  # the same tokens, each stage's own layers' K/V
    for (tier, caches), payload in zip(tiers, payloads, strict=True):
        found = read_block(tier.directory, key, tier.fingerprint.digest, tier.fingerprint.short, tokens)
        assert isinstance(found, BlockRecord) and found.payload == payload
        fresh = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
        write_block(fresh, 0, found.payload)
        assert all(torch.equal(fk[0], k[2]) and torch.equal(fv[0], v[2])
                   for (fk, fv), (k, v) in zip(fresh, caches, strict=True))
    # Stage 0's file put where stage 1 looks for the same key: refused (another fingerprint), deleted.
    (t0, _), (t1, _) = tiers
    theirs = t1.directory / file_name(key, t1.fingerprint.short)
    shutil.copy(t0.directory / file_name(key, t0.fingerprint.short), theirs)
    found = read_block(t1.directory, key, t1.fingerprint.digest, t1.fingerprint.short, tokens)
    assert isinstance(found, Skipped) and "another model" in found.reason and not theirs.exists()
    for tier, _ in tiers:
        tier.close()
