"""Shared helpers for the disk tier's tests: a fingerprint and chained block records."""

from __future__ import annotations

import os

from bargein.engine.block_keys import chain_hash
from bargein.engine.kv_disk.block_file import BlockRecord
from bargein.engine.kv_disk.fingerprint import ModelFingerprint

BLOCK = 4
FP = ModelFingerprint(files=(("tiny.gguf", 1234, "ab" * 16),), precision="fast", kv_dtype="float16",
                      block_size=BLOCK, layer_range=(0, 2))
OTHER_FP = ModelFingerprint(files=(("other.gguf", 1234, "cd" * 16),), precision="fast", kv_dtype="float16",
                            block_size=BLOCK, layer_range=(0, 2))


def chain(tokens: list[int], payload_size: int = 64, seed: int = 0) -> list[BlockRecord]:
    """Records for the full blocks of ``tokens``, chained, with payloads derived from the keys."""
    records, parent = [], None
    for i in range(len(tokens) // BLOCK):
        block = tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
        key = chain_hash(parent, block)
        payload = (key * (payload_size // len(key) + 1))[:payload_size] if seed == 0 else os.urandom(payload_size)
        records.append(BlockRecord(key, parent, block, payload))
        parent = key
    return records
