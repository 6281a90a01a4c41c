"""One block's K/V as bytes, and back: the disk tier's payload.

A stage's caches are one ``(k, v)`` pair per layer, each ``(num_blocks, block_size,
num_kv_heads, head_dim)`` in the K/V dtype. A block's payload is, layer by layer in the
stage's order, its K rows then its V rows, as raw bytes of that dtype: a round trip is
bit-exact for any dtype (float16, bfloat16, float32), so a block read back attends
exactly as the one computed (C4). What the layout depends on (dtype, block size, layer
range, the model's head shapes) is in the model fingerprint, and the length is checked.

The only module of ``kv_disk`` that imports torch. Spilling a step's evicted blocks
costs their copy out of the caches on the step thread (about 0.3 ms per SmolLM2-135M
block of 360 KiB on the CPU, measured on a busy 2-core machine); hashing and file writes
happen on the tier's writer thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

KVPair = tuple[torch.Tensor, torch.Tensor]


def block_nbytes(caches: Sequence[KVPair]) -> int:
    """Bytes of one block's payload over every layer of ``caches``."""
    return sum(t[0].numel() * t.element_size() for pair in caches for t in pair)


def extract_blocks(caches: Sequence[KVPair], block_ids: Sequence[int]) -> list[bytes]:
    """The payloads of ``block_ids``, in that order.

    On the CPU each block's rows are copied straight out of the caches' memory (no
    intermediate tensor); on a GPU, one gather per cache tensor and one copy to the host.
    """
    if not block_ids:
        return []
    if caches[0][0].device.type == "cpu":
        rows = [t.reshape(t.shape[0], -1).view(torch.uint8).numpy() for pair in caches for t in pair]
        return [b"".join([r[b].tobytes() for r in rows]) for b in block_ids]
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=caches[0][0].device)
    n = len(block_ids)
    rows = [t.index_select(0, ids).reshape(n, -1).view(torch.uint8) for pair in caches for t in pair]
    table = torch.cat(rows, dim=1).cpu().numpy()  # (n, block_nbytes)
    return [table[i].tobytes() for i in range(n)]


def extract_block(caches: Sequence[KVPair], block_id: int) -> bytes:
    """One block's payload."""
    return extract_blocks(caches, [block_id])[0]


def write_block(caches: Sequence[KVPair], block_id: int, payload: bytes) -> None:
    """Writes a payload from ``extract_blocks`` into ``block_id`` of every layer's caches.

    Raises ValueError if its length is not this layout's (nothing is written then).
    """
    if not all(t.is_contiguous() for pair in caches for t in pair):
        raise ValueError("the K/V caches must be contiguous")
    expected = block_nbytes(caches)
    if len(payload) != expected:
        raise ValueError(f"a block payload of {len(payload)} bytes, this cache layout takes {expected}")
    if caches[0][0].device.type == "cpu":  # straight into the caches' memory
        data = np.frombuffer(payload, dtype=np.uint8)
        offset = 0
        for pair in caches:
            for t in pair:
                row = t.reshape(t.shape[0], -1).view(torch.uint8).numpy()[block_id]  # a view
                row[:] = data[offset:offset + row.size]
                offset += row.size
        return
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    offset = 0
    for pair in caches:
        for t in pair:
            dst = t[block_id].reshape(-1).view(torch.uint8)  # a view: block rows are contiguous
            dst.copy_(data[offset:offset + dst.numel()])
            offset += dst.numel()
