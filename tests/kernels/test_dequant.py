"""Torch dequantization against gguf's numpy reference and against hand-computed blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as numpy_dequantize

from bargein.kernels.dequant import SUPPORTED_TYPES, dequantize

# byte offsets of the float16 scale fields in each block type
F16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(qtype: str, num_blocks: int, seed: int = 0) -> np.ndarray:
    """Random block bytes with finite float16 scales."""
    rng = np.random.default_rng(seed)
    _, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.standard_normal(num_blocks).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return raw


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS))
def test_block_types_match_numpy_reference(qtype: str) -> None:
    t = GGMLQuantizationType[qtype]
    block_elems, _ = GGML_QUANT_SIZES[t]
    raw = random_blocks(qtype, 48).reshape(6, -1)  # 6 rows of 8 blocks
    expected = numpy_dequantize(raw, t)
    got = dequantize(raw, t, (6, 8 * block_elems))
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_float_types(qtype: str) -> None:
    values = torch.randn(3, 64)
    t = GGMLQuantizationType[qtype]
    if qtype == "F32":
        raw = values.numpy()
    elif qtype == "F16":
        raw = values.half().numpy()
    else:
        raw = values.bfloat16().view(torch.int16).numpy().view(np.uint8).reshape(3, 128)
    got = dequantize(raw, t, (3, 64))
    expected = {"F32": values, "F16": values.half().float(), "BF16": values.bfloat16().float()}[
        qtype
    ]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_supported_types() -> None:
    names = {t.name for t in SUPPORTED_TYPES}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"} <= names


def _f16_bytes(x: float) -> bytes:
    return np.float16(x).tobytes()


def test_q4_k_hand_built_block() -> None:
    # d = 0.5, dmin = 0.25; sub-block j has scale j + 1 and min 2j (j < 4: 6-bit fields in
    # bytes 0-7; j >= 4: low 4 bits in bytes 8-11, high 2 bits in the top of bytes 0-7)
    scales, mins = [j + 1 for j in range(8)], [2 * j for j in range(8)]
    packed = bytearray(12)
    for j in range(4):
        packed[j] = scales[j] | ((scales[j + 4] >> 4) << 6)
        packed[j + 4] = mins[j] | ((mins[j + 4] >> 4) << 6)
        packed[j + 8] = (scales[j + 4] & 0xF) | ((mins[j + 4] & 0xF) << 4)
    quants = [(e * 7 + j) % 16 for j in range(8) for e in range(32)]  # sub-block j, element e
    qs = bytearray(128)
    for g in range(4):  # each 32 bytes: low nibbles = sub-block 2g, high = 2g + 1
        for e in range(32):
            qs[32 * g + e] = quants[64 * g + e] | (quants[64 * g + 32 + e] << 4)
    block = _f16_bytes(0.5) + _f16_bytes(0.25) + bytes(packed) + bytes(qs)
    expected = [0.5 * scales[i // 32] * quants[i] - 0.25 * mins[i // 32] for i in range(256)]
    got = dequantize(np.frombuffer(block, np.uint8), GGMLQuantizationType.Q4_K, (256,))
    assert got.tolist() == expected


def test_q5_k_hand_built_block() -> None:
    # all scales 1 (6-bit), mins 0; element i of sub-block j gets fifth bit from qh[i] bit j
    d = 0.125
    packed = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])
    quants = [(i * 5) % 32 for i in range(256)]
    qh = bytearray(32)
    qs = bytearray(128)
    for j in range(8):
        for e in range(32):
            q = quants[32 * j + e]
            qh[e] |= (q >> 4) << j
            nibble = q & 0xF
            qs[32 * (j // 2) + e] |= nibble if j % 2 == 0 else nibble << 4
    block = _f16_bytes(d) + _f16_bytes(1.0) + packed + bytes(qh) + bytes(qs)
    got = dequantize(np.frombuffer(block, np.uint8), GGMLQuantizationType.Q5_K, (256,))
    assert got.tolist() == [d * q for q in quants]


def test_q6_k_hand_built_block() -> None:
    # 16 sub-blocks of 16 with int8 scales; q in [0, 64) stored as 4 low bits in ql and
    # 2 high bits in qh, value = d * scale * (q - 32)
    d = 0.25
    scales = [(-1) ** s * (s + 1) for s in range(16)]
    quants = [(i * 11) % 64 for i in range(256)]
    ql, qh = bytearray(128), bytearray(64)
    for half in range(2):
        for quarter in range(4):
            for e in range(32):
                q = quants[128 * half + 32 * quarter + e]
                ql_index = 64 * half + 32 * (quarter % 2) + e
                ql[ql_index] |= (q & 0xF) << (4 * (quarter // 2))
                qh[32 * half + e] |= (q >> 4) << (2 * quarter)
    block = bytes(ql) + bytes(qh) + np.array(scales, np.int8).tobytes() + _f16_bytes(d)
    got = dequantize(np.frombuffer(block, np.uint8), GGMLQuantizationType.Q6_K, (256,))
    assert got.tolist() == [d * scales[i // 16] * (quants[i] - 32) for i in range(256)]
