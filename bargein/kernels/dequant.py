"""Vectorised torch dequantization of GGML tensor types (llama.cpp's block formats).

Each function takes the raw bytes of whole blocks as a (num_blocks, block_bytes) uint8
tensor and returns (num_blocks, block_elements) float32. Layouts follow ggml-quants.c;
gguf.quants (numpy) is the reference the tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from bargein.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
Dequantizer = Callable[[torch.Tensor], torch.Tensor]


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian float16 at byte ``start`` of each block, as (num_blocks, 1) float32."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k) packed bytes -> (n, 2k): all low nibbles, then all high nibbles (ggml order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """(n, count // 8) bytes -> (n, count) bits, little-endian within each byte."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(packed.shape[0], count)


def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16), qs (32 x int8)
    return _f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16), qs (16 bytes, 32 nibbles); value = d * (q - 8)
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8.0)


def dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16), m (f16), qs (16 bytes); value = d * q + m
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)


def dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16), qh (32 high bits), qs (16 bytes); value = d * (q - 16)
    q = _nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6], 32) << 4)
    return _f16(blocks, 0) * (q.float() - 16.0)


def dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16), m (f16), qh (32 high bits), qs (16 bytes); value = d * q + m
    q = _nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8], 32) << 4)
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins each."""
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _k_quants_4bit(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> 256 values: each 32-byte group gives 32 low nibbles then 32 high ones."""
    groups = qs.reshape(qs.shape[0], 4, 32)
    return torch.stack([groups & 0x0F, groups >> 4], dim=2).reshape(qs.shape[0], 8, 32)


def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: d, dmin (f16), scales (12), qs (128); 8 sub-blocks of 32
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    q = _k_quants_4bit(blocks[:, 16:144]).float()  # (n, 8, 32)
    out = (d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)
    return out.reshape(blocks.shape[0], QK_K)


def dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: d, dmin (f16), scales (12), qh (32), qs (128)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    low = _k_quants_4bit(blocks[:, 48:176])  # (n, 8, 32)
    # sub-block j takes bit j of qh[l] as the fifth bit of its element l
    high = (blocks[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    q = (low | (high << 4)).float()
    out = (d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)
    return out.reshape(blocks.shape[0], QK_K)


def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: ql (128), qh (64), scales (16 x int8), d (f16); 16 sub-blocks of 16
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 2, 32)  # (half, low/high 32 bytes, l)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16)
    d = _f16(blocks, 208)
    # in each half of 128: quarter k uses nibble (k // 2) of ql[(k % 2) * 32 + l], bits 2k of qh
    low = torch.stack(
        [ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2
    )
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (qh >> shifts) & 3  # (n, 2, 4, 32)
    q = ((low | (high << 4)).float() - 32.0).reshape(n, 16, 16)
    return (d.unsqueeze(-1) * scales.unsqueeze(-1) * q).reshape(n, QK_K)


def dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: scales (16: low nibble scale, high nibble min), qs (64), d, dmin (f16); 16 sub-blocks of 16
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0x0F).float()).unsqueeze(-1)  # (n, 16, 1)
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    # value h * 128 + s * 32 + l is bits 2s of qs[h * 32 + l]
    q = ((blocks[:, 16:80].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: hmask (32), qs (64), scales (12, six-bit signed packed), d (f16); 16 sub-blocks of 16
    n = blocks.shape[0]
    hmask, qs, packed = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks, 108)
    low = torch.cat([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], dim=-1)  # (n, 16)
    high = ((packed[:, 8:12].unsqueeze(1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 4, 1)) & 3)
    scales = (low | (high.reshape(n, 16) << 4)).to(torch.int16) - 32
    dl = (d * scales.float()).unsqueeze(-1)  # (n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    # value i takes bit i // 32 of hmask[i % 32]; a clear bit subtracts 4
    qh = (hmask.reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    q = ql.reshape(n, 256).to(torch.int16) - ((qh.reshape(n, 256) ^ 1).to(torch.int16) << 2)
    return (dl * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16), qs (16 bytes, 32 nibbles indexing IQ4_NL_VALUES)
    values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)
    return _f16(blocks, 0) * values[_nibbles(blocks[:, 2:]).long()]


def dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: d (f16), scales_h (u16: 2 high bits per 32), scales_l (4 bytes: 4 low bits per 32), qs (128)
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    scales_h = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # (n, 1)
    low = torch.stack([blocks[:, 4:8] & 0x0F, blocks[:, 4:8] >> 4], dim=-1).reshape(n, 8).to(torch.int32)
    high = (scales_h >> (2 * torch.arange(8, dtype=torch.int32))) & 3
    dl = (d * ((low | (high << 4)) - 32).float()).unsqueeze(-1)  # (n, 8, 1)
    values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)
    q = values[_nibbles(blocks[:, 8:136].reshape(n * 8, 16)).long()].reshape(n, 8, 32)
    return (dl * q).reshape(n, QK_K)


def dequant_f16(blocks: torch.Tensor) -> torch.Tensor:
    # one little-endian IEEE half per "block" of 2 bytes, widened exactly
    return blocks.contiguous().view(torch.float16).float()


def dequant_bf16(blocks: torch.Tensor) -> torch.Tensor:
    # one bfloat16 per "block" of 2 bytes: the top half of a float32, widened exactly
    return blocks.contiguous().view(torch.bfloat16).float()


DEQUANTIZERS: dict[GGMLQuantizationType, Dequantizer] = {
    GGMLQuantizationType.F16: dequant_f16,
    GGMLQuantizationType.BF16: dequant_bf16,
    GGMLQuantizationType.Q8_0: dequant_q8_0,
    GGMLQuantizationType.Q4_0: dequant_q4_0,
    GGMLQuantizationType.Q4_1: dequant_q4_1,
    GGMLQuantizationType.Q5_0: dequant_q5_0,
    GGMLQuantizationType.Q5_1: dequant_q5_1,
    GGMLQuantizationType.Q4_K: dequant_q4_k,
    GGMLQuantizationType.Q5_K: dequant_q5_k,
    GGMLQuantizationType.Q6_K: dequant_q6_k,
    GGMLQuantizationType.Q2_K: dequant_q2_k,
    GGMLQuantizationType.Q3_K: dequant_q3_k,
    GGMLQuantizationType.IQ4_NL: dequant_iq4_nl,
    GGMLQuantizationType.IQ4_XS: dequant_iq4_xs,
}
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
SUPPORTED_TYPES = frozenset(DEQUANTIZERS) | frozenset(FLOAT_TYPES)


def dequantize(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Raw GGUF tensor data -> float32 torch tensor of torch ``shape`` (row-major).

    ``raw`` is what the file holds: typed elements for F32/F16, bytes otherwise.
    The caller checks ``qtype in SUPPORTED_TYPES``.
    """
    numel = int(np.prod(shape))
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(np.array(raw, dtype=np.float32).reshape(shape))
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(raw, dtype=np.float16).reshape(shape)).float()
    data = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1))
    if qtype == GGMLQuantizationType.BF16:
        return data.view(torch.bfloat16).float().reshape(shape)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(numel // block_elems, block_bytes)
    return DEQUANTIZERS[qtype](blocks).reshape(shape)
