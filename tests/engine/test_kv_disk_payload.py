"""A block's K/V to bytes and back: bit-exact in every cache dtype, other blocks untouched.

The caches live on ``BARGEIN_TEST_DEVICE`` (default cpu), so a GPU run checks the
device-to-host gather and the host-to-device write too."""

from __future__ import annotations

import pytest
import torch

from bargein.engine.kv_disk.payload import block_nbytes, extract_block, extract_blocks, write_block
from tests.tiny_engine import target_device


def caches(dtype: torch.dtype, num_blocks: int = 6, layers: int = 3, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 4, 2, 8)  # (num_blocks, block_size, kv_heads, head_dim)
    device = target_device()
    return [(torch.randn(shape, generator=g).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype))
            for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    src, dst = caches(dtype, seed=1), caches(dtype, seed=2)
    before = [(k.clone(), v.clone()) for k, v in dst]
    payloads = extract_blocks(src, [4, 1])
    assert payloads[0] == extract_block(src, 4) and len(payloads[1]) == block_nbytes(src)
    assert block_nbytes(src) == 3 * 2 * 4 * 2 * 8 * torch.tensor([], dtype=dtype).element_size()
    write_block(dst, 0, payloads[0])
    write_block(dst, 5, payloads[1])
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before, strict=True):
        assert torch.equal(dk[0].view(torch.uint8), sk[4].view(torch.uint8))
        assert torch.equal(dv[5].view(torch.uint8), sv[1].view(torch.uint8))
        for b in (1, 2, 3, 4):  # no other block was written
            assert torch.equal(dk[b], bk[b]) and torch.equal(dv[b], bv[b])


def test_nan_and_infinity_survive() -> None:
    src, dst = caches(torch.float16), caches(torch.float16, seed=3)
    src[0][0][2, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0], device=src[0][0].device)
    write_block(dst, 2, extract_block(src, 2))
    assert torch.equal(dst[0][0][2].view(torch.int16), src[0][0][2].view(torch.int16))


def test_a_payload_of_another_layout_is_refused_and_writes_nothing() -> None:
    small, big = caches(torch.float16, layers=2), caches(torch.float16, layers=3)
    before = big[0][0].clone()
    with pytest.raises(ValueError, match="bytes"):
        write_block(big, 0, extract_block(small, 0))
    assert torch.equal(big[0][0], before)
    assert extract_blocks(small, []) == []
