"""The GGUF block kernels (gguf_matmul.c) for every type, against gguf.quants and float64.

Blocks are random but valid (tests/gguf_blocks.py). Each type's native rows equal
gguf.quants' dequantization bit for bit; ``exact`` is a float64 product of those values
to float32 rounding; ``fast`` is the stated int8 arithmetic (a float64 product of the
int8-rounded activations, to float32 rounding; inputs with outlier channels, so that the
K chain's per-32 steps vary within a superblock) and gives the same bits for every row
count, thread count, instruction-set path (those this CPU lacks are skipped by name),
segment mix and row order; Q4_1 and Q8_0 read from the file's layout give exactly what
a BlockWeight of the same blocks gives in quant_matmul.c.
"""

from __future__ import annotations

import ctypes
import mmap
import warnings

import numpy as np
import pytest
import torch

from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.dequant import DEQUANTIZERS
from bargein.kernels.ggml_types import GGML_QUANT_SIZES
from bargein.kernels.native import Q8_ISAS, load_native_kernels
from bargein.kernels.native_structs import describe_quant
from bargein.kernels.ops import KernelSet
from bargein.kernels.quant_weight import QuantSegment, QuantWeight
from bargein.loader.gguf_file import qk_row_order
from tests.gguf_blocks import TYPES, T, gguf_dequantize, random_blocks, random_weight
from tests.kernels.isa_params import isa_params
from tests.kernels.stealing import assert_each_output_written_once, gguf_run

KERNELS = load_native_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler here; the reference path is tested")
EPS = float(np.finfo(np.float32).eps)
PROT_NONE = 0  # mprotect's no-access protection (Python's mmap module does not name it)
TYPE_IDS = [t.name for t in TYPES]
ROWS = [1, 3, 7, 13, 33]


ISAS = isa_params(KERNELS)  # this architecture's paths only


def rng_for(*key: object) -> np.random.Generator:
    return np.random.default_rng(abs(hash(tuple(str(k) for k in key))) % 2**32)


def mixed_weight(rng: np.random.Generator, k: int = 512) -> QuantWeight:
    """A fused matrix as a Q4_K_M file makes it: Q4_K rows (reordered), then Q6_K, then Q8_0, ragged."""
    parts = [random_weight(T.Q4_K, 24, k, rng, order=True), random_weight(T.Q6_K, 9, k, rng),
             random_weight(T.Q8_0, 19, k, rng, order=True), random_weight(T.IQ4_XS, 5, k, rng)]
    return QuantWeight.cat_rows(parts)


def reference_values(weight: QuantWeight) -> np.ndarray:
    return np.concatenate([gguf_dequantize(s) for s in weight.segments])


# The types on the K chain (gguf_matmul.c): one float unit per superblock of 256; Q4_K's
# and Q5_K's activations take it as their one step (K_FLAT, as llama.cpp's Q8_K), Q6_K's a
# step per 32-block that is an integer multiple of it.
K_CHAIN = (T.Q4_K, T.Q5_K, T.Q6_K)
K_FLAT = (T.Q4_K, T.Q5_K)


def rounded_per_block(x: np.ndarray, block: int) -> np.ndarray:
    """x rounded to int8 on one step per block, d * rint(x / d), d = max|x| / 127 (float32
    steps): the 32 chain's rounding (block 32); per 256, llama.cpp's Q8_K's."""
    m, k = x.shape
    blocks = x.reshape(m, k // block, block).astype(np.float32)
    d = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint((blocks * inv).astype(np.float32)), -127, 127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)


def k_chain_activations(x: np.ndarray) -> np.ndarray:
    """x as the K chain rounds it (gguf_matmul.c's header, float32 steps in its order): per
    superblock d = max|x| / 127, per 32-block j the multiple m_j = ceil(max_j / max * 16) in
    1..16 and the step (d * m_j) / 16; the value kq * m_j * (d / 16), kq = rint(x / step)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 256, 8, 32).astype(np.float32)
    amax32 = np.abs(blocks).max(-1)
    amax = amax32.max(-1, keepdims=True)
    ratio = (amax32 / np.where(amax > 0, amax, 1)).astype(np.float32) * np.float32(16)
    mult = np.where(amax > 0, np.clip(np.ceil(ratio), 1, 16), 1).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    step = ((d * mult).astype(np.float32) * np.float32(0.0625)).astype(np.float32)
    inv = np.where(step > 0, np.float32(1) / np.where(step > 0, step, 1), 0).astype(np.float32)
    q = np.clip(np.rint((blocks * inv[..., None]).astype(np.float32)), -127, 127)
    unit = (d * np.float32(0.0625)).astype(np.float64)
    return (q * mult[..., None].astype(np.float64) * unit[..., None]).reshape(m, k)


def int8_activations(x: np.ndarray, qtype: T) -> np.ndarray:
    """x as the fast kernels round it for a weight of type qtype: the 32 chain's, one step
    per superblock (K_FLAT), or the K chain's per-32 multiples (Q6_K)."""
    if qtype in K_FLAT:
        return rounded_per_block(x, 256)
    return k_chain_activations(x) if qtype in K_CHAIN else rounded_per_block(x, 32)


def with_outliers(x: np.ndarray, every: int = 97, scale: float = 40.0) -> np.ndarray:
    """x with a few large channels (every ``every``-th value times ``scale``), as the input of
    a model's ffn_down has: a superblock's step is set by them, its other 32-blocks' are not."""
    x = x.copy()
    x.reshape(-1)[5::every] *= scale
    return x


def fast_bound(xq: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Float32 rounding of the block chain: per block a product and a fused add or two, and
    the mins' sums (which can cancel against the quants' part: the second term)."""
    nb = w.shape[1] // 32
    scale = np.abs(xq) @ np.abs(w).T + np.abs(xq).sum(1, keepdims=True) * np.abs(w).max()
    return 4 * (nb + 2) * EPS * scale + 1e-30


@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_torch_reference_dequantizes_as_gguf(qtype):
    blocks = random_blocks(qtype, 6, 512, rng_for("torch", qtype))
    segment = QuantSegment(qtype, blocks)
    ours = segment.dequantize_rows().numpy()
    assert np.array_equal(ours.view(np.int32), gguf_dequantize(segment).view(np.int32))
    assert qtype in DEQUANTIZERS


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_native_rows_are_gguf_values(qtype):
    rng = rng_for("rows", qtype)
    weight = QuantWeight.cat_rows([random_weight(qtype, 21, 512, rng, order=True), random_weight(T.Q5_1, 4, 512, rng)])
    ref = reference_values(weight)
    ids = torch.from_numpy(rng.integers(0, 25, size=17)).to(torch.int64)
    for threads in (1, 3):
        rows = KERNELS.quant_rows(describe_quant(weight), ids, threads).numpy()
        assert np.array_equal(rows.view(np.int32), ref[ids.numpy()].view(np.int32))


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_exact_is_the_float64_product(qtype):
    rng = rng_for("exact", qtype)
    k = 512
    weight = random_weight(qtype, 40, k, rng, order=True)
    w = reference_values(weight).astype(np.float64)
    kernels = KernelSet(KERNELS, fast=False)
    for m in (1, 3, 33):  # C for few rows, widened chunks and PyTorch's GEMM for many
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        ref = x.double().numpy() @ w.T
        bound = 2 * (k + 2) * EPS * (np.abs(x.double().numpy()) @ np.abs(w).T) + 1e-30
        ys = [kernels.quant_linear(x, weight).numpy()]
        ys += [KERNELS.quant_matmul(x, describe_quant(weight), 2, exact=True, isa=isa).numpy()
               for isa in ("c", "avx2") if KERNELS.q8_isa_available(isa)]  # each exact path
        for y in ys:
            assert (np.abs(y - ref) <= bound).all(), (m, np.abs(y - ref).max())


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_fast_is_the_int8_product(qtype):
    rng = rng_for("fast", qtype)
    k = 768
    weight = random_weight(qtype, 35, k, rng)
    w = reference_values(weight).astype(np.float64)
    x = with_outliers(rng.standard_normal((13, k)).astype(np.float32))
    x[3] = 0.0  # an all-zero row: d = 0
    x[4, 256:288] = 0.0  # an all-zero 32-block: the K chain's multiple is 1
    y = KERNELS.quant_matmul(torch.from_numpy(x), describe_quant(weight), 2, isa="c").numpy()
    xq = int8_activations(x, qtype)
    assert (np.abs(y - xq @ w.T) <= fast_bound(xq, w)).all()


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=TYPE_IDS)
def test_fast_bits_do_not_depend_on_rows_threads_or_path(qtype, isa):
    rng = rng_for("invariant", qtype)
    k = 512
    weight = QuantWeight.cat_rows([random_weight(qtype, 29, k, rng, order=True), random_weight(qtype, 6, k, rng)])
    matrix = describe_quant(weight)
    x = torch.from_numpy(with_outliers(rng.standard_normal((max(ROWS), k)).astype(np.float32)))
    base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
    for m in ROWS:
        for threads in (1, 2, 3):
            y = KERNELS.quant_matmul(x[:m].contiguous(), matrix, threads, isa=isa)
            assert torch.equal(y, base[:m]), (m, threads)
    # one row alone, from the middle of the batch
    assert torch.equal(KERNELS.quant_matmul(x[5:6].contiguous(), matrix, 2, isa=isa), base[5:6])


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in K_CHAIN and GGML_QUANT_SIZES[t][0] == 32],
                         ids=lambda t: t.name)
def test_an_odd_count_of_32_blocks_keeps_the_bits(qtype, isa):
    """k of 23 blocks: the few-row passes take blocks two at a time and the last alone, the
    offset's terms of a missing second block included; every row count of the few-row and
    tile passes, one thread and three, equal the plain C path."""
    rng = rng_for("odd", qtype)
    k = 23 * 32
    matrix = describe_quant(QuantWeight.cat_rows([random_weight(qtype, 21, k, rng, order=True),
                                                   random_weight(qtype, 11, k, rng)]))
    x = torch.from_numpy(with_outliers(rng.standard_normal((9, k)).astype(np.float32)))
    base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
    for m in range(1, 10):
        for threads in (1, 3):
            assert torch.equal(KERNELS.quant_matmul(x[:m].contiguous(), matrix, threads, isa=isa), base[:m]), (m, threads)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [t for t in TYPES if t in K_CHAIN or GGML_QUANT_SIZES[t][0] == 32],
                         ids=lambda t: t.name)
def test_few_rows_over_rows_in_stored_order_keep_the_bits(qtype, isa):
    """One to four rows (a decode of as many streams): eight columns that are rows evenly
    apart (a segment in its stored order, or every other row under the Q/K row order) take
    AVX2's strided passes (pair_rows_avx2_t, k_rows_avx2_t on the K chain; up to four rows
    a pass), each tile's next one fetched ahead; the others (a random row order, a segment's
    last few rows) the general ones. Segments of 37 rows in order (four strided groups, five
    rows left), 19 through a random order, 64 through the Q/K order of one head and 24 in
    order; k of 64 blocks and of 23 (the odd last block after the loop), on the K chain of 8
    superblocks and of 3: the C path's bits, one thread and two, for each run of one to four
    rows from the middle of a batch."""
    rng = rng_for("one-row-strided", qtype)
    for k in (8 * 256, 3 * 256) if qtype in K_CHAIN else (64 * 32, 23 * 32):
        qk = random_weight(qtype, 64, k, rng).reorder_rows(qk_row_order(64, 1))
        matrix = describe_quant(QuantWeight.cat_rows([random_weight(qtype, 37, k, rng),
                                                      random_weight(qtype, 19, k, rng, order=True), qk,
                                                      random_weight(qtype, 24, k, rng)]))
        x = torch.from_numpy(with_outliers(rng.standard_normal((5, k)).astype(np.float32)))
        base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
        for n in range(1, 5):
            for r in range(6 - n):
                for threads in (1, 2):
                    y = KERNELS.quant_matmul(x[r:r + n].contiguous(), matrix, threads, isa=isa)
                    assert torch.equal(y, base[r:r + n]), (k, n, r, threads)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_k_chain_tile_passes_keep_the_bits_at_every_row_remainder(isa):
    """The K chain's many-row tile passes (from 6 rows) take rows 8 at a time on VNNI and 4
    on AVX2 (every type): 6 .. 13 and 24 .. 31 rows end in every remainder of each
    (6 and 7: a tile read by one short pass), and the first pass over
    each tile fetches the next one's blocks (across segments and row orders here); 64 .. 71
    rows end in every remainder of several passes. Q6_K's passes read their rows'
    activations and terms in groups of eight rows on VNNI, four on AVX2 (short last
    groups in every remainder), and on VNNI from 160 rows its scales times each row's m
    from a table built per tile: 160 .. 167 rows end in every remainder there."""
    rng = rng_for("k-tails")
    k = 512
    weight = QuantWeight.cat_rows([random_weight(T.Q4_K, 21, k, rng, order=True), random_weight(T.Q6_K, 19, k, rng),
                                   random_weight(T.Q5_K, 17, k, rng, order=True)])
    matrix = describe_quant(weight)
    x = torch.from_numpy(with_outliers(rng.standard_normal((167, k)).astype(np.float32)))
    base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
    for m in [*range(4, 14), *range(24, 32), *range(64, 72), *range(160, 168)]:
        for threads in (1, 2):
            assert torch.equal(KERNELS.quant_matmul(x[:m].contiguous(), matrix, threads, isa=isa), base[:m]), (m, threads)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_k_chain_sets_of_tiles_keep_the_bits(isa):
    """From 48 rows AMX takes the K chain in items of several tiles (as many as fit 1 MB of
    scaled quants and leave each thread 4 items: here 11 and 5 at k = 512 on one and two
    threads, 2 and 1 at k = 16,384), 16 rows at a time over the whole set,
    the rest of the rows tile by tile: a segment of 2 1/2 sets beside a Q6_K one (a set of
    one full tile and 5 columns) and a Q5_K one, sets cut short by their segment, row
    remainders 0, 5 and 15, threads taking each other's items, and one expert's call of 70
    rows equal the C path's bits (the other paths run the same shapes)."""
    rng = rng_for("amx-sets")
    library = ctypes.CDLL(str(KERNELS.path))
    expert = library.bargein_gguf_matmul_expert
    expert.restype = ctypes.c_int
    expert.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    for k, n_q4 in ((512, 16 * 40 + 9), (16384, 16 * 5 + 3)):
        weight = QuantWeight.cat_rows([random_weight(T.Q4_K, n_q4, k, rng, order=True),
                                       random_weight(T.Q6_K, 21, k, rng), random_weight(T.Q5_K, 37, k, rng)])
        matrix = describe_quant(weight)
        x = torch.from_numpy(with_outliers(rng.standard_normal((79, k)).astype(np.float32)))
        base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
        for m in (48, 64, 69, 79):
            for threads in (1, 2):
                y = KERNELS.quant_matmul(x[:m].contiguous(), matrix, threads, isa=isa)
                assert torch.equal(y, base[:m]), (k, m, threads)
        rows = x[:70].contiguous()
        y = torch.empty((70, weight.shape[0]), dtype=torch.float32)
        assert expert(rows.data_ptr(), 70, ctypes.addressof(matrix.struct), y.data_ptr(), 0, Q8_ISAS[isa]) == 0
        assert torch.equal(y, base[:70]), k


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_a_tensor_ending_its_mapping_is_read_within_it(qtype, isa):
    """A tensor's last block can end the file's mapping (a GGUF's last tensor ends the file):
    no path may read a byte past it. The blocks end exactly at a page that no access is
    allowed to; a read past them (Q6_K's d is its block's last two bytes) would fault."""
    page = mmap.PAGESIZE
    rng = rng_for("mapping-end", qtype.name)
    blocks = random_blocks(qtype, 9, 256, rng).numpy()
    buffer = mmap.mmap(-1, 2 * page)
    base_address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base_address + page), ctypes.c_size_t(page), PROT_NONE) == 0
    at = page - blocks.size
    buffer[at:page] = blocks.tobytes()
    data = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, count=blocks.size, offset=at).reshape(blocks.shape))
    matrix = describe_quant(QuantWeight((QuantSegment(qtype, data, None),)))
    x = torch.from_numpy(rng.standard_normal((9, 256)).astype(np.float32))
    base = KERNELS.quant_matmul(x, describe_quant(QuantWeight((QuantSegment(qtype, torch.from_numpy(blocks), None),))),
                                1, isa="c")
    for m in (1, 3, 6, 9):
        assert torch.equal(KERNELS.quant_matmul(x[:m].contiguous(), matrix, 2, isa=isa), base[:m]), m


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_plain_kinds_signed_tiles_keep_the_bits(isa):
    """From 32 rows on VNNI, 8 on AVX2, the tile passes of the types whose D needs only an
    offset read their quants signed against the activations plus 128, their lanes started
    from the tile's -128 * sum q: on VNNI all of them (Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS), on
    AVX2 those whose quants fit maddubs' pairs so (Q4_0, Q5_0; the others keep the unsigned
    pass in the same call, as Q4_1 does on both). Row counts across both thresholds, and
    64 .. 69 rows ending in every remainder of VNNI's passes of six and AVX2's of two."""
    rng = rng_for("signed-tiles")
    k = 512
    weight = QuantWeight.cat_rows([random_weight(T.Q4_0, 21, k, rng, order=True), random_weight(T.Q5_0, 17, k, rng),
                                   random_weight(T.Q8_0, 16, k, rng), random_weight(T.IQ4_NL, 9, k, rng),
                                   random_weight(T.IQ4_XS, 18, k, rng), random_weight(T.Q4_1, 7, k, rng)])
    matrix = describe_quant(weight)
    x = torch.from_numpy(with_outliers(rng.standard_normal((69, k)).astype(np.float32)))
    base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
    for m in (7, 8, 9, 31, 32, 33, *range(64, 70)):
        for threads in (1, 2):
            assert torch.equal(KERNELS.quant_matmul(x[:m].contiguous(), matrix, threads, isa=isa), base[:m]), (m, threads)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_eight_bit_tiles_at_their_int16_bounds_keep_the_bits(isa):
    """The AVX2 pass of 8-bit quants (from 32 rows) multiplies |q| by x XORed with q's sign
    mask (-x - 1 where q < 0) and starts its lanes from the tile's sum of |q| over the
    negative q: at q = -128 against x = +127 a maddubs pair is 2 * 128 * -128, int16's
    least. Q8_0 columns whose quants are all -128, all +127 or alternate; rows of +127, -127
    and random signs; the C path's bits at row counts across the threshold and every
    remainder of the pass's four rows, one thread and two."""
    rng = rng_for("eight-bit-bounds")
    k = 512
    data = random_blocks(T.Q8_0, 24, k, rng).numpy().copy()
    blocks = data.reshape(24, k // 32, 34)
    blocks[0::3, :, 2:] = 0x80  # q = -128
    blocks[1::3, :, 2:] = 0x7F  # q = +127
    blocks[2::3, :, 2::2] = 0x80
    matrix = describe_quant(QuantWeight((QuantSegment(T.Q8_0, torch.from_numpy(data), None),)))
    signs = [np.ones(k), -np.ones(k)] + [rng.choice([-1.0, 1.0], size=k) for _ in range(35)]
    x = torch.from_numpy(np.stack([signs[r % 3] if r < 12 else signs[r] for r in range(37)]).astype(np.float32))
    base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
    for m in (31, 32, 33, 34, 35, 36, 37):
        for threads in (1, 2):
            assert torch.equal(KERNELS.quant_matmul(x[:m].contiguous(), matrix, threads, isa=isa), base[:m]), (m, threads)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_signed_tiles_at_their_int16_bounds_keep_the_bits(isa):
    """The AVX2 signed pass sums its maddubs pairs in int16 over 8 groups for Q4_0 and 4 for
    Q5_0: at q = -8 (-16) against activations of +127 (plus 128: 255) those sums reach
    8 * 2 * 255 * 8 = 4 * 2 * 255 * 16 = 32640 beside int16's 32767. Every other column's
    quants at their most negative; rows of +127, -127 and random signs; the C path's bits
    at row counts of both signed passes, one thread and two."""
    rng = rng_for("signed-bounds")
    k = 512
    segments = []
    for qtype, quants in ((T.Q4_0, slice(2, 18)), (T.Q5_0, slice(2, 22))):
        data = random_blocks(qtype, 16, k, rng).numpy().copy()
        values, nbytes = GGML_QUANT_SIZES[qtype]
        data.reshape(16, k // values, nbytes)[::2, :, quants] = 0  # q = u - off at its least
        segments.append(QuantWeight((QuantSegment(qtype, torch.from_numpy(data), None),)))
    matrix = describe_quant(QuantWeight.cat_rows(segments))
    signs = [np.ones(k), -np.ones(k)] + [rng.choice([-1.0, 1.0], size=k) for _ in range(31)]
    x = torch.from_numpy(np.stack([signs[r % 3] if r < 9 else signs[r] for r in range(33)]).astype(np.float32))
    base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
    for m in (8, 9, 32, 33):
        for threads in (1, 2):
            assert torch.equal(KERNELS.quant_matmul(x[:m].contiguous(), matrix, threads, isa=isa), base[:m]), (m, threads)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_threads_that_take_each_others_tiles_compute_every_tile_once(isa):
    """A thread done with its share of the tiles takes the others' from their backs (work
    stealing): with more threads than cores they are descheduled mid-call and steal often.
    Every output (filled with NaN before the call) comes out written, with the bits of one
    thread, across segments and row orders, on the few-row and the tile passes."""
    rng = rng_for("stealing")
    k = 256
    weight = QuantWeight.cat_rows([random_weight(T.Q4_0, 16 * 37 + 5, k, rng, order=True),
                                   random_weight(T.Q4_K, 16 * 21 + 3, k, rng), random_weight(T.Q8_0, 40, k, rng)])
    matrix = describe_quant(weight)
    x = torch.from_numpy(rng.standard_normal((32, k)).astype(np.float32))
    for m in (1, 5, 32):
        base = KERNELS.quant_matmul(x[:m].contiguous(), matrix, 1, isa="c")
        assert_each_output_written_once(gguf_run(KERNELS, x[:m], matrix, isa), base)


def _blocks_at_their_bounds(qtype: T, n: int, k: int, rng: np.random.Generator) -> QuantWeight:
    """(n, k) of ``qtype`` whose columns put the K chain's integer sums at their bounds, by
    column c % 4: every quant, scale and min at its largest (Q6_K: u = 63 and scales -128 or
    127, alternating); the same scales and mins, random quants; every quant 0 (Q6_K: q = -32,
    the most negative), the scales at their largest; all random. The float16 fields stay
    tests/gguf_blocks.py's."""
    data = random_blocks(qtype, n, k, rng).numpy().copy()
    values, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(n, k // values, nbytes)
    quants, scales = {T.Q4_K: (slice(16, 144), slice(4, 16)), T.Q5_K: (slice(16, 176), slice(4, 16)),
                      T.Q6_K: (slice(0, 192), slice(192, 208))}[qtype]
    for c in range(n):
        if c % 4 == 3:
            continue
        blocks[c, :, scales] = (0x80 if c % 8 < 4 else 0x7F) if qtype == T.Q6_K else 0xFF
        if c % 4 == 0:
            blocks[c, :, quants] = 0xFF
        elif c % 4 == 2:
            blocks[c, :, quants] = 0
    return QuantWeight((QuantSegment(qtype, torch.from_numpy(data), None),))


def _activations_at_their_bounds(m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """m rows whose K-chain quants are +-127 in every 32-block (every |x| equal; Q6_K's
    multiple 16): all positive, all negative, alternating, random signs; then random signs
    with one 32-block per superblock 100 times smaller (Q6_K: a small multiple beside 16s;
    Q4_K and Q5_K, flat: that block's quants near 1)."""
    signs = [np.ones(k), -np.ones(k), np.resize([1.0, -1.0], k)]
    x = np.stack([signs[r] if r < 3 else rng.choice([-1.0, 1.0], size=k) for r in range(m)]).astype(np.float32)
    x[6:, 32:64] *= np.float32(0.01)
    return x


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", K_CHAIN, ids=[t.name for t in K_CHAIN])
def test_k_chain_integer_sums_at_their_bounds_keep_the_bits(qtype, isa):
    """Quants, scales, mins and activations at their extremes (one 32-block's four-product
    sums at 4 * 63 * 127 for Q6_K's pairs, 16 products of Q4_K's quads at 16 * 15 * 127 =
    30480 beside int16's 32767; D at 16 * 128 * 16 * 16 * 32 * 127 for Q6_K): an int16 or
    int32 sum that overflowed or saturated on some path would change the bits. Every row
    count from 1 to 12 through the dense matmul (VNNI: passes of up to 4 rows) and through
    one expert's call (bargein_gguf_matmul_expert: passes of up to 8, split evenly), Q4_K's
    from 2 rows in the quad pass, equals the C path's bits; so do 24 and 25 rows, the tile
    passes (AVX2: a 32-block's pairs summed in int16, Q4_K's eight at 16 * 15 * 127 = 30480,
    Q5_K's halves at 8 * 31 * 127 = 31496, before the madd by sc; Q6_K's halves from the
    row's offsets, wrapping on the way, at 8 * 32 * 127 = 32512 where q = -32), and 64 and 73, AMX's
    (its operands' bytes at their bounds: Q6_K's w = -128 * -32 = 256 * 16 + 0, Q4_K's and
    Q5_K's one-byte a = +-127 against w = 63 * 15 or 63 * 31)."""
    rng = rng_for("bounds", qtype)
    k = 512
    weight = _blocks_at_their_bounds(qtype, 32, k, rng)
    matrix = describe_quant(weight)
    x = torch.from_numpy(_activations_at_their_bounds(73, k, rng))
    base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
    for m in (24, 25, 64, 73):
        assert torch.equal(KERNELS.quant_matmul(x[:m].contiguous(), matrix, 2, isa=isa), base[:m]), m
    library = ctypes.CDLL(str(KERNELS.path))  # the loaded library: its exported expert call
    expert = library.bargein_gguf_matmul_expert
    expert.restype = ctypes.c_int
    expert.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    for m in range(1, 13):
        rows = x[:m].contiguous()
        assert torch.equal(KERNELS.quant_matmul(rows, matrix, 2, isa=isa), base[:m]), m
        y = torch.empty((m, weight.shape[0]), dtype=torch.float32)
        assert expert(rows.data_ptr(), m, ctypes.addressof(matrix.struct), y.data_ptr(), 0, Q8_ISAS[isa]) == 0
        assert torch.equal(y, base[:m]), m


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], ids=["Q4_K", "Q5_K"])
def test_k_chain_tile_mins_at_int16_bounds_keep_the_bits(qtype, isa):
    """The tile passes (from 24 rows) sum the mins as int16 pairs against each row's pairs
    of 32-block sums (the activations are flat: sum q itself, at most 32 * 127 = 4064):
    rows whose every 32-block's quants are all +127 or all -127 (sum q = +-4064), 24 of
    +127 and 8 of -127 (2032), 25 and 7, and random signs. Quants, scales and mins at their
    extremes (as above); the C path's bits at every row remainder of both tile passes, one
    thread and two."""
    rng = rng_for("tile-mins", qtype)
    k = 512
    matrix = describe_quant(_blocks_at_their_bounds(qtype, 32, k, rng))
    fits, wide = np.resize([1.0] * 24 + [-1.0] * 8, k), np.resize([1.0] * 25 + [-1.0] * 7, k)
    rows = [(wide if r % 2 else -wide) if 8 <= r < 16 else
            [fits, -fits, np.ones(k), -np.ones(k), rng.choice([-1.0, 1.0], size=k)][r % 5] for r in range(71)]
    x = torch.from_numpy(np.stack(rows).astype(np.float32) * np.float32(0.5))
    base = KERNELS.quant_matmul(x, matrix, 1, isa="c")
    for m in [*range(24, 32), *range(64, 72)]:
        for threads in (1, 2):
            assert torch.equal(KERNELS.quant_matmul(x[:m].contiguous(), matrix, threads, isa=isa), base[:m]), (m, threads)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_mixed_segments_and_orders(isa):
    rng = rng_for("mixed")
    weight = mixed_weight(rng)
    w = reference_values(weight).astype(np.float64)
    # 70 rows: the tile passes, on AMX too (from 48 rows), with both of the K chain's
    # roundings of the rows in one call (Q4_K's flat, Q6_K's per 32)
    x = with_outliers(rng.standard_normal((70, 512)).astype(np.float32))
    whole = KERNELS.quant_matmul(torch.from_numpy(x), describe_quant(weight), 3, isa=isa)
    # each segment alone gives its columns' bits, each the int8 product of its chain
    start = 0
    for segment in weight.segments:
        xq, ws = int8_activations(x, segment.qtype), w[start:start + segment.rows]
        assert (np.abs(whole.numpy()[:, start:start + segment.rows] - xq @ ws.T) <= fast_bound(xq, ws)).all()
        alone = KERNELS.quant_matmul(torch.from_numpy(x), describe_quant(QuantWeight((segment,))), 1, isa="c")
        assert torch.equal(alone, whole[:, start:start + segment.rows])
        start += segment.rows
    exact = KernelSet(KERNELS).quant_linear(torch.from_numpy(x[:2]), weight).numpy()
    ref = x[:2].astype(np.float64) @ w.T
    assert (np.abs(exact - ref) <= 2 * 514 * EPS * (np.abs(x[:2]) @ np.abs(w).T) + 1e-30).all()


@needs_kernels
def test_q6_k_steps_per_32_beat_one_step_per_256_on_outlier_channels():
    """One outlier channel per superblock (as ffn_down's input has) sets the superblock's
    step; Q6_K's per-32 multiples keep the other 32-blocks' steps fine, so the product's
    error against float is well below that of one step per 256 on the same input (Q4_K's
    and Q5_K's activations take that one step: test_fast_is_the_int8_product)."""
    qtype = T.Q6_K
    rng = np.random.default_rng(3300 + qtype)  # fixed: the ratio is about 0.35, from 0.28 to 0.48 over seeds
    k = 1024
    weight = random_weight(qtype, 64, k, rng)
    w = reference_values(weight).astype(np.float64)
    x = rng.standard_normal((8, k)).astype(np.float32)
    x[:, 7::256] = 60.0 * np.sign(x[:, 7::256])  # one channel per superblock, far above the rest
    y = KERNELS.quant_matmul(torch.from_numpy(x), describe_quant(weight), 1, isa="c").numpy()
    ref = x.astype(np.float64) @ w.T
    error = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    per_256 = np.linalg.norm(rounded_per_block(x, 256) @ w.T - ref) / np.linalg.norm(ref)
    per_32 = np.linalg.norm(rounded_per_block(x, 32) @ w.T - ref) / np.linalg.norm(ref)
    assert error < 0.6 * per_256, (error, per_256)
    assert error < 1.5 * per_32, (error, per_32)  # about the 32 chain's own error


def _block_weight(qtype, data: torch.Tensor, n: int, k: int) -> BlockWeight:
    """The BlockWeight of the same Q4_1/Q8_0 blocks (as the loader reads them today)."""
    raw = data.reshape(n, k // 32, -1)
    d = raw[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    if qtype == T.Q8_0:
        return BlockWeight(8, raw[..., 2:].contiguous().view(torch.int8), d.contiguous(), None)
    m = raw[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    return BlockWeight(4, raw[..., 4:].contiguous(), d.contiguous(), m.contiguous())


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=["Q4_1", "Q8_0"])
def test_q4_1_and_q8_0_from_the_file_equal_block_weights(qtype, isa):
    rng = rng_for("blockweight", qtype)
    n, k = 70, 576  # the bundled model's width: 18 blocks, not a multiple of 256
    data = random_blocks(qtype, n, k, rng)
    blocks = _block_weight(qtype, data, n, k)
    matrix = describe_quant(QuantWeight.of(qtype, data, n, k))
    for m in (1, 7, 33):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        assert torch.equal(KERNELS.quant_matmul(x, matrix, 2, isa=isa), KERNELS.q8_block_matmul(x, blocks, 2, isa=isa))


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=["Q4_1", "Q8_0"])
def test_block_weight_threads_that_take_each_others_groups_compute_every_group_once(qtype, isa):
    """quant_matmul.c's groups (eight columns; tiles of sixteen from its many-row threshold)
    are shares that threads steal from, as gguf_matmul.c's tiles: every output, NaN before
    the call, comes out written with one thread's bits while 2-8 threads take them."""
    rng = rng_for("blockweight-stealing", qtype)
    n, k = 16 * 23 + 5, 576
    blocks = _block_weight(qtype, random_blocks(qtype, n, k, rng), n, k)
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    mins = blocks.mins.data_ptr() if blocks.mins is not None else None
    for m in (1, 5, 40):
        rows = x[:m].contiguous()
        base = KERNELS.q8_block_matmul(rows, blocks, 1, isa="c")
        assert_each_output_written_once(
            lambda y, threads, rows=rows: KERNELS._q8_matmul(rows.data_ptr(), rows.shape[0], k, blocks.qs.data_ptr(),
                                                             blocks.scales.data_ptr(), mins, blocks.bits, n,
                                                             y.data_ptr(), threads, Q8_ISAS[isa]), base)


@needs_kernels
def test_read_only_mapped_blocks_are_read_in_place(tmp_path):
    rng = rng_for("mmap")
    data = random_blocks(T.Q4_K, 16, 512, rng)
    path = tmp_path / "blocks.bin"
    path.write_bytes(data.numpy().tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=tuple(data.shape))
    with warnings.catch_warnings():  # torch warns (once per process) that the array is not writable
        warnings.simplefilter("ignore")
        view = torch.from_numpy(mapped)
    weight = QuantWeight((QuantSegment(T.Q4_K, view),))
    x = torch.randn(3, 512)
    for kernels in (KernelSet(KERNELS, fast=True), KernelSet(KERNELS)):
        assert torch.equal(kernels.quant_linear(x, weight),
                           kernels.quant_linear(x, QuantWeight((QuantSegment(T.Q4_K, data.clone()),))))


def test_without_native_kernels_the_reference_runs():
    rng = rng_for("reference")
    weight = mixed_weight(rng)
    x = torch.randn(4, 512)
    kernels = KernelSet()
    assert torch.equal(kernels.quant_linear(x, weight), torch.nn.functional.linear(x, weight.dequantize()))
    ids = torch.tensor([0, 56, 30])
    assert torch.equal(kernels.quant_embedding(weight, ids), weight.dequantize()[ids])


@needs_kernels
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_kernel_set_embedding_and_linear(fast):
    rng = rng_for("set", fast)
    weight = mixed_weight(rng)
    kernels = KernelSet(KERNELS, fast=fast)
    ids = torch.tensor([3, 0, 56, 30, 3])
    assert torch.equal(kernels.quant_embedding(weight, ids), weight.dequantize()[ids])
    x = torch.randn(2, 3, 512)
    y = kernels.quant_linear(x, weight)
    assert y.shape == (2, 3, 57)
    assert torch.equal(y.reshape(6, 57), kernels.quant_linear(x.reshape(6, 512), weight))


@needs_kernels
def test_a_described_weight_is_freed_with_its_weight():
    import gc
    import weakref

    weight = random_weight(T.Q4_K, 16, 256, rng_for("freed"))
    assert describe_quant(weight) is describe_quant(weight)  # described once
    alive = weakref.ref(weight.segments[0].data)
    del weight
    gc.collect()
    assert alive() is None
