"""CPU kernels of our own, written in C, compiled on first use and called through ctypes.

PyTorch has no kernel for attention straight out of a paged KV cache, and on the CPU
its way there (gather the blocks, then scaled_dot_product_attention one head at a time)
spends most of a decode step's attention time copying and re-reading keys. The C
source next to this module does it in one pass over the cache.

The library is built with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``),
with ``-O3`` and the architecture's flags (build_flags.py: ``-march=native`` on x86-64), into a cache folder keyed by the source, the compiler and
the CPU, so that it is built once per machine (a few seconds) and shared by every
process. The compiler enters the key as the file it resolves to, with that file's size
and modification time (an upgrade or another compiler changes them), so that a start
with the library built runs no compiler at all. Where no compiler is found, the build fails, or ``BARGEIN_NATIVE_KERNELS=0``
is set, :func:`load_native_kernels` returns None and callers use PyTorch instead: the
kernels make bargein faster, never possible.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from bargein.kernels import build_flags
from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.moe_native import MoEKernels
from bargein.kernels.native_structs import (
    FastEmbed,
    FastHead,
    FastLayer,
    FastShape,
    NativeKernelError,
    QuantMatrix,
)

log = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "decode_attention.c", "block_matmul.c", "quant_matmul.c", "attention_f16.c", "rowwise.c", "parallel.c",
    "fast_forward.c", "gguf_matmul.c", "moe_matmul.c", "half_matmul.c"))
_HEADERS = tuple(Path(__file__).with_name(name) for name in (
    "parallel.h", "simd.h", "gguf_types.h", "gguf_matrix.h", "moe_matmul.h", "x86_simd.h", "half_matmul.h", "fast_forward.h",
    "arm64_simd.h", "neon_block_matmul.h", "neon_q8_matmul.h", "neon_q8_body.h", "neon_gguf_matmul.h",
    "neon_gguf_body.h", "neon_attention_f16.h", "tanh.h", "exp.h", "neon_int8_tile.h", "neon_q8_tile.h",
    "neon_gguf_tile.h", "attention_prompt_x86.h", "gguf_tile_zmm.h", "gguf_tile_amx.h"))
_FLAGS = build_flags.COMMON_FLAGS
# Tried in order until one builds (build_flags.py: per architecture and CPU).
_VARIANTS = build_flags.compile_variants()
_P = ctypes.c_void_p
_I64, _INT = ctypes.c_int64, ctypes.c_int
# The int8 matmul's instruction sets, by the number quant_matmul.c knows them by.
Q8_ISAS = {"c": 0, "avx2": 1, "vnni": 2, "neon": 3, "dotprod": 4, "amx": 5}


class NativeKernels:
    """The loaded library; each method states the tensors it takes."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        self._library = library
        self._decode = library.bargein_paged_decode_attention
        self._decode.restype = ctypes.c_int
        self._decode.argtypes = [_P, _P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        self._matmul = library.bargein_block_matmul
        self._matmul.restype = ctypes.c_int
        self._matmul.argtypes = [_P, ctypes.c_int64, ctypes.c_int64, _P, _P, _P, ctypes.c_int, ctypes.c_int64, _P,
                                 ctypes.c_int]
        self._q8_matmul = library.bargein_q8_block_matmul
        self._q8_matmul.restype = _INT
        self._q8_matmul.argtypes = [_P, _I64, _I64, _P, _P, _P, _INT, _I64, _P, _INT, _INT]
        self._q8_isa_available = library.bargein_q8_isa_available
        self._q8_isa_available.restype = _INT
        self._q8_isa_available.argtypes = [_INT]
        self._attention_f16 = library.bargein_paged_attention_f16_ex
        self._attention_f16.restype = _INT
        self._attention_f16.argtypes = [_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _INT, _INT, _INT, _INT,
                                        ctypes.c_float, _I64, ctypes.c_float, _INT]
        self._rope_store = library.bargein_rope_store_f16
        self._rope_store.restype = None
        self._rope_store.argtypes = [_P, _P, _P, _P, _P, _P, _P, _I64, _INT, _INT, _INT, _INT]
        self._rms_norm = library.bargein_rms_norm
        self._rms_norm.restype = None
        self._rms_norm.argtypes = [_P, _P, _P, _I64, _I64, ctypes.c_float, _INT]
        self._silu_mul = library.bargein_silu_mul
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_P, _P, _I64, _I64, _INT]
        self._gelu_tanh_mul = library.bargein_gelu_tanh_mul
        self._gelu_tanh_mul.restype = None
        self._gelu_tanh_mul.argtypes = [_P, _P, _I64, _I64, _INT]
        self._softcap = library.bargein_softcap
        self._softcap.restype = None
        self._softcap.argtypes = [_P, _P, _I64, _I64, ctypes.c_float, _INT]
        self._fast_layers = library.bargein_fast_layers
        self._fast_layers.restype = _INT
        self._fast_layers.argtypes = [_P, _INT, _P, _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _I64, _INT, _INT]
        self._fast_workspace_floats = library.bargein_fast_workspace_floats
        self._fast_workspace_floats.restype = _I64
        self._fast_workspace_floats.argtypes = [_P, _I64]
        self._gguf_matmul = library.bargein_gguf_matmul
        self._gguf_matmul.restype = _INT
        self._gguf_matmul.argtypes = [_P, _I64, _P, _P, _INT, _INT, _INT]
        self._gguf_rows = library.bargein_gguf_dequantize_rows
        self._gguf_rows.restype = _INT
        self._gguf_rows.argtypes = [_P, _P, _I64, _P, _INT]
        self.q8_isa = self._chosen_q8_isa()
        self.moe = MoEKernels(library)  # routing and grouped experts (moe_matmul.c)

    def _chosen_q8_isa(self) -> int:
        """The int8 instruction set to use here, or the one ``BARGEIN_Q8_ISA`` (c, avx2, vnni,
        amx, neon, dotprod) names."""
        forced = os.environ.get("BARGEIN_Q8_ISA", "").strip().lower()
        if forced:
            if forced not in Q8_ISAS or not self.q8_isa_available(forced):
                raise NativeKernelError(f"BARGEIN_Q8_ISA={forced!r}: choose one of "
                                        f"{', '.join(n for n in Q8_ISAS if self.q8_isa_available(n))}")
            return Q8_ISAS[forced]
        # AMX (VNNI's paths, with the K-quant tile pass on tile registers from 64 rows)
        # before VNNI: a 512-token prefill of a 1B Q4_K_M / Q5_K_M file 1.16-1.25x as fast
        # on a Sapphire-Rapids-class VM with Q4_K/Q5_K on AMX alone (gguf_tile_amx.h); the
        # same bits.
        # VNNI before AVX2: one vpdpbusd for maddubs + madd, and twice the registers (on the
        # Zen 4 measured, 1.1-1.3x AVX2's speed from 1 to 512 rows: bench/bench_q8_matmul.py).
        # On ARM64, sdot before plain NEON (one instruction for a widening multiply and two adds).
        return next(Q8_ISAS[n] for n in ("amx", "vnni", "avx2", "dotprod", "neon", "c") if self.q8_isa_available(n))

    def q8_isa_available(self, name: str) -> bool:
        """Whether this CPU runs the int8 matmul's ``name`` path (c, avx2, vnni, amx, neon or
        dotprod); amx also needs Linux's permission for the tile state, asked here once."""
        return bool(self._q8_isa_available(Q8_ISAS[name]))

    def q8_block_matmul(self, x: torch.Tensor, weight: BlockWeight, num_threads: int,
                        isa: str | None = None) -> torch.Tensor:
        """``x @ W.T`` with x quantized to int8 per block of 32 (see quant_matmul.c).

        x (m, k) contiguous float32 on the CPU. Row r of the result depends on row r of x
        and the weight only: not on m, the thread count or ``isa`` (default: the best here).
        """
        n, k = weight.shape
        _check_rows(x, k)
        y = torch.empty((x.shape[0], n), dtype=torch.float32)
        mins = weight.mins.data_ptr() if weight.mins is not None else None
        status = self._q8_matmul(x.data_ptr(), x.shape[0], k, weight.qs.data_ptr(), weight.scales.data_ptr(), mins,
                                 weight.bits, n, y.data_ptr(), num_threads,
                                 self.q8_isa if isa is None else Q8_ISAS[isa])
        if status == -2:
            raise NativeKernelError(f"this CPU has no {isa} instructions")
        if status:
            raise NativeKernelError("the int8 matmul kernel could not allocate its scratch memory")
        return y

    def quant_matmul(self, x: torch.Tensor, weight: QuantMatrix, num_threads: int, *, exact: bool = False,
                     isa: str | None = None) -> torch.Tensor:
        """``x @ W.T`` for W held in a GGUF file's blocks (see gguf_matmul.c), x (m, k)
        contiguous float32 on the CPU.

        ``exact=False`` (fast): x quantized to int8 per block of 32; row r of the result
        depends on row r of x and the weight only, not on m, the thread count or ``isa``
        (default: the best here). ``exact=True``: float32 activations (plain C).
        """
        n, k = weight.weight.shape
        _check_rows(x, k)
        y = torch.empty((x.shape[0], n), dtype=torch.float32)
        status = self._gguf_matmul(x.data_ptr(), x.shape[0], ctypes.addressof(weight.struct), y.data_ptr(),
                                   int(exact), num_threads, self.q8_isa if isa is None else Q8_ISAS[isa])
        _gguf_status(status, isa)
        return y

    def quant_rows(self, weight: QuantMatrix, ids: torch.Tensor, num_threads: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (int64) of W widened to float32 (len(ids), k), the values gguf.quants
        gives; written into ``out`` (contiguous float32) when given."""
        n, k = weight.weight.shape
        ids = ids.to(torch.int64).contiguous().view(-1)
        if out is None:
            out = torch.empty((ids.shape[0], k), dtype=torch.float32)
        elif out.dtype != torch.float32 or not out.is_contiguous() or out.shape != (ids.shape[0], k):
            raise NativeKernelError(f"out must be contiguous float32 ({ids.shape[0]}, {k})")
        _gguf_status(self._gguf_rows(ctypes.addressof(weight.struct), ids.data_ptr(), ids.shape[0], out.data_ptr(),
                                     num_threads), None)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, num_threads: int) -> torch.Tensor:
        """RMS norm of each row of x (m, n) times weight (n,); each row by the same code."""
        _check_rows(x, weight.shape[0])
        if weight.dtype != torch.float32 or not weight.is_contiguous():
            raise NativeKernelError("the norm weight must be a contiguous float32 tensor")
        y = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps, num_threads)
        return y

    def silu_mul(self, x: torch.Tensor, num_threads: int) -> torch.Tensor:
        """``silu(a) * b`` for x (m, 2n) = [a | b]; returns (m, n); each row by the same code."""
        _check_rows(x, x.shape[1] if x.dim() == 2 and x.shape[1] % 2 == 0 else -1)
        y = torch.empty((x.shape[0], x.shape[1] // 2), dtype=torch.float32)
        self._silu_mul(x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1] // 2, num_threads)
        return y

    def gelu_tanh_mul(self, x: torch.Tensor, num_threads: int) -> torch.Tensor:
        """``gelu_tanh(a) * b`` for x (m, 2n) = [a | b] (GeGLU); returns (m, n); each row by the same code."""
        _check_rows(x, x.shape[1] if x.dim() == 2 and x.shape[1] % 2 == 0 else -1)
        y = torch.empty((x.shape[0], x.shape[1] // 2), dtype=torch.float32)
        self._gelu_tanh_mul(x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1] // 2, num_threads)
        return y

    def softcap(self, x: torch.Tensor, cap: float, num_threads: int) -> torch.Tensor:
        """``cap * tanh(x / cap)`` of each value of x (m, n); each row by the same code."""
        _check_rows(x, x.shape[1] if x.dim() == 2 else -1)
        y = torch.empty_like(x)
        self._softcap(x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], cap, num_threads)
        return y

    def rope_store_f16(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_threads: int) -> torch.Tensor:
        """Rotates each token's query and key of qkv (T, (H + 2 KVH) D) by its angles cos, sin
        (T, D), writes key and value to the float16 caches at ``slot_mapping`` (T,) and
        returns the queries (T, H, D) float32. Token by token, by the same code."""
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        t = qkv.shape[0]
        _check_rows(qkv, (num_heads + 2 * num_kv_heads) * head_dim)
        if any(a.dtype != torch.float32 or not a.is_contiguous() or a.shape[0] != t or a.numel() != t * head_dim
               for a in (cos, sin)):
            raise NativeKernelError("cos and sin must be contiguous float32, one row of head_dim per token")
        if any(c.dtype != torch.float16 or not c.is_contiguous() or c.device.type != "cpu" for c in (k_cache, v_cache)) \
                or v_cache.shape != k_cache.shape:
            raise NativeKernelError("the caches must be contiguous float16 CPU tensors of one shape")
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (t,) or not slot_mapping.is_contiguous():
            raise NativeKernelError("one int64 slot per token is needed")
        if t and not 0 <= int(slot_mapping.min()) <= int(slot_mapping.max()) < num_blocks * block_size:
            raise NativeKernelError("a slot lies outside the cache")
        q = torch.empty((t, num_heads, head_dim), dtype=torch.float32)
        self._rope_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(), k_cache.data_ptr(),
                         v_cache.data_ptr(), q.data_ptr(), t, num_heads, num_kv_heads, head_dim, num_threads)
        return q

    def paged_attention_f16(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_seq: torch.Tensor, query_ctx: torch.Tensor,
                            scale: float, num_threads: int, *, window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
        """Each query (T, H, D) float32 over its sequence's first ``query_ctx`` positions of the
        float16 caches (num_blocks, block_size, KVH, D), found through ``block_tables[query_seq]``;
        with ``window``, over the last ``window`` of them only; with ``softcap``, scores
        soft-capped (see attention_f16.c).

        The caller guarantees what is too costly to check per layer: every ``query_ctx`` is at
        least 1 and within the table row (``AttentionMetadata.build`` checks this once per step).
        A query's result depends on nothing but its own inputs (see attention_f16.c).
        """
        num_queries, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if q.dtype != torch.float32 or not q.is_contiguous() or q.device.type != "cpu":
            raise NativeKernelError("q must be a contiguous float32 CPU tensor")
        if any(c.dtype != torch.float16 or not c.is_contiguous() or c.device.type != "cpu" for c in (k_cache, v_cache)):
            raise NativeKernelError("the caches must be contiguous float16 CPU tensors")
        if v_cache.shape != k_cache.shape or k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
            raise NativeKernelError(f"shapes do not fit: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
        index = (block_tables, query_seq, query_ctx)
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in index) \
                or query_seq.shape != (num_queries,) or query_ctx.shape != (num_queries,):
            raise NativeKernelError("one int64 sequence index and context length per query are needed")
        out = torch.empty_like(q)
        status = self._attention_f16(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                                     block_tables.shape[1], query_seq.data_ptr(), query_ctx.data_ptr(),
                                     out.data_ptr(), num_queries, num_heads, num_kv_heads, head_dim, block_size,
                                     scale, window or 0, softcap or 0.0, num_threads)
        if status:
            raise NativeKernelError("the float16 attention kernel could not allocate its scratch memory")
        return out

    def fast_layers(self, layers: ctypes.Array[FastLayer], shape: FastShape, x: torch.Tensor,
                    positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                    token_seq: torch.Tensor, token_ctx: torch.Tensor, embed: FastEmbed | None,
                    head: FastHead | None, workspace: torch.Tensor, num_threads: int) -> None:
        """Runs the fast forward of every layer in ``layers`` on x (m, hidden), in place (x
        first written from ``embed``'s rows of its token ids if given), then ``head`` if
        given (it writes its logits) (see fast_forward.c): bit for bit what the
        per-operation kernels above compute in turn. Where ``head`` asks for fewer rows
        than x has, the last layer's attention and MLP run on those rows alone and x keeps
        that layer's input: the logits are the call's output.

        ``layers``, ``shape``, ``embed`` and ``head`` are prepared by the caller
        (bargein.model.fused_layers), so this checks only the per-call tensors' layout. The
        caller guarantees what the attention kernel's caller does (every context at least 1
        and within its table row); slots, positions, token ids and logits rows are checked
        in C, before anything is written. ``workspace``: a contiguous float32 CPU tensor of at
        least :meth:`fast_workspace_floats` elements for this many rows, where the call keeps
        its buffers (the caller's to reuse from call to call).
        """
        m = x.shape[0]
        _check_rows(x, shape.hidden)
        if any(t.dtype != torch.int64 or not t.is_contiguous() or t.shape != (m,)
               for t in (positions, slots, token_seq, token_ctx)) \
                or block_tables.dtype != torch.int64 or not block_tables.is_contiguous() or block_tables.dim() != 2:
            raise NativeKernelError("one int64 position, slot, sequence and context per token and int64 block "
                                    "tables are needed")
        if workspace.dtype != torch.float32 or workspace.device.type != "cpu" or not workspace.is_contiguous():
            raise NativeKernelError("the workspace must be a contiguous float32 CPU tensor")
        status = self._fast_layers(ctypes.addressof(layers), len(layers), ctypes.addressof(shape), x.data_ptr(), m,
                                   positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                                   block_tables.shape[1], token_seq.data_ptr(), token_ctx.data_ptr(),
                                   None if embed is None else ctypes.addressof(embed),
                                   None if head is None else ctypes.addressof(head), workspace.data_ptr(),
                                   workspace.numel(), num_threads, self.q8_isa)
        if status in _FAST_LAYER_ERRORS:
            raise NativeKernelError(_FAST_LAYER_ERRORS[status])
        if status:
            raise NativeKernelError("the fused fast forward could not allocate its scratch memory")

    def fast_workspace_floats(self, shape: FastShape, rows: int) -> int:
        """The float32 elements of :meth:`fast_layers`' workspace for a call of ``rows`` rows."""
        return int(self._fast_workspace_floats(ctypes.addressof(shape), rows))

    def block_matmul(self, x: torch.Tensor, weight: BlockWeight, num_threads: int) -> torch.Tensor:
        """``x @ W.T`` for x (m, k) contiguous float32 on the CPU and W block-quantized (n, k)."""
        n, k = weight.shape
        _check_rows(x, k)
        y = torch.empty((x.shape[0], n), dtype=torch.float32)
        mins = weight.mins.data_ptr() if weight.mins is not None else None
        status = self._matmul(x.data_ptr(), x.shape[0], k, weight.qs.data_ptr(), weight.scales.data_ptr(), mins,
                              weight.bits, n, y.data_ptr(), num_threads)
        if status:
            raise NativeKernelError("the block matmul kernel could not allocate its scratch memory")
        return y

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, num_threads: int) -> torch.Tensor:
        """Attention of one query per sequence over its paged keys and values.

        q (B, H, D) and the caches (num_blocks, block_size, KVH, D) float32 on the CPU;
        block_tables (B, W) and context_lens (B,) contiguous int64. The caller guarantees
        what is too costly to check per layer: every context length is at least 1 and
        table i holds at least ``ceil(context_lens[i] / block_size)`` ids of existing
        blocks (``AttentionMetadata.build`` checks this once per step). Returns (B, H, D).
        """
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        tensors = (q, k_cache, v_cache)
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise NativeKernelError("q and the caches must be contiguous float32 CPU tensors")
        if v_cache.shape != k_cache.shape or k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
            raise NativeKernelError(f"shapes do not fit: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
        if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,) \
                or not block_tables.is_contiguous() or not context_lens.is_contiguous():
            raise NativeKernelError("one block table and one context length per sequence are needed")
        if block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64:
            raise NativeKernelError("block tables and context lengths must be int64")
        out = torch.empty_like(q)
        status = self._decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                              context_lens.data_ptr(), out.data_ptr(), num_seqs, block_tables.shape[1],
                              num_heads, num_kv_heads, head_dim, block_size, scale, num_threads)
        if status:
            raise NativeKernelError("the decode attention kernel could not allocate its scratch memory")
        return out


_FAST_LAYER_ERRORS = {-2: "this CPU lacks the int8 matmul's chosen instruction set",
                      -3: "a slot lies outside the cache", -4: "a position lies outside the RoPE tables",
                      -5: "a logits row is not a row of the forward", -6: "a token id is not in the vocabulary",
                      -7: "a GGUF weight's block type has no native kernels",
                      -8: "the workspace is smaller than fast_workspace_floats"}


def _gguf_status(status: int, isa: str | None) -> None:
    if status == -2:
        raise NativeKernelError(f"this CPU has no {isa} instructions")
    if status == -3:
        raise NativeKernelError("a segment's block type has no native kernels, or its rows are not whole blocks")
    if status == -6:
        raise NativeKernelError("a row id lies outside the matrix")
    if status:
        raise NativeKernelError("the GGUF block kernel could not allocate its scratch memory")


def _check_rows(x: torch.Tensor, k: int) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.dim() != 2:
        raise NativeKernelError("x must be a contiguous 2-D float32 CPU tensor")
    if x.shape[1] != k:
        raise NativeKernelError(f"x has {x.shape[1]} columns; {k} are needed")


def cache_dir() -> Path:
    """Where built kernels are kept: ``$BARGEIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/bargein``."""
    if explicit := os.environ.get("BARGEIN_CACHE_DIR"):
        return Path(explicit) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bargein" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _compiler_identity(compiler: str) -> str:
    """The compiler as the file it resolves to, with its size and modification time: what
    changes when it is upgraded or another one is chosen, read without running it (running
    ``cc --version`` on every start cost a process start). Raises OSError if it is gone."""
    path = os.path.realpath(shutil.which(compiler) or compiler)
    stat = os.stat(path)
    return f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}"


def library_path(compiler: str, target_dir: Path) -> Path:
    """Where the library built by ``compiler`` from today's sources, flags and CPU lives in
    ``target_dir`` (it may not be built yet). Raises OSError when a source or the
    compiler cannot be read."""
    source = b"\0".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    key = hashlib.sha256(b"\0".join([source, repr((_VARIANTS, _FLAGS)).encode(), _compiler_identity(compiler).encode(),
                                     platform.machine().encode(), build_flags.cpu_signature().encode()])).hexdigest()[:16]
    return target_dir / f"bargein_kernels_{key}.so"


def build_library(compiler: str, target_dir: Path) -> Path:
    """Compiles the kernels (or finds them already built); returns the library's path.

    Raises OSError or subprocess.CalledProcessError when the build fails.
    """
    path = library_path(compiler, target_dir)
    if path.exists():
        return path
    target_dir.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: processes starting together never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target_dir)
    os.close(fd)
    try:
        for i, variant in enumerate(_VARIANTS):
            try:
                _compile(compiler, (*variant, *_FLAGS), tmp)
                break
            except subprocess.CalledProcessError:
                if i == len(_VARIANTS) - 1:
                    raise  # the plainest build failed too: the compiler's message goes up
                log.info("the native kernels did not build with %r; trying the next flags", variant)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _compile(compiler: str, flags: tuple[str, ...], output: str) -> None:
    """Compiles every source to an object, as many at once as there are cores, then links.

    One compiler process per source: gguf_matmul.c alone takes ~20 s of CPU, the others
    together ~8 s, so on two cores a first start waits for the longest file, not the sum.
    Raises the first failing compile's CalledProcessError (its stderr is the message).
    """
    def run(args: list[str]) -> None:
        subprocess.run(args, capture_output=True, text=True, check=True, timeout=300)

    with tempfile.TemporaryDirectory(prefix="bargein-kernels-") as folder:
        objects = [os.path.join(folder, f"{source.stem}.o") for source in _SOURCES]
        workers = max(1, min(len(_SOURCES), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            # The longest first, so that it never waits behind the short ones.
            order = sorted(range(len(_SOURCES)), key=lambda i: -_SOURCES[i].stat().st_size)
            futures = [pool.submit(run, [compiler, *flags, "-c", "-o", objects[i], str(_SOURCES[i])]) for i in order]
        for future in futures:
            future.result()
        run([compiler, *flags, "-o", output, *objects, "-lm"])


@functools.cache
def load_native_kernels() -> NativeKernels | None:
    """The native kernels, built if need be; None (with one logged reason) where unavailable."""
    if os.environ.get("BARGEIN_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found; decode attention runs on PyTorch kernels (slower)")
        return None
    try:
        path = build_library(compiler, cache_dir())
        kernels = NativeKernels(ctypes.CDLL(str(path)), path)
        if note := build_flags.arm64_fallback_note(kernels.q8_isa_available("dotprod")):
            log.warning(note)
        return kernels
    except subprocess.CalledProcessError as exc:
        log.warning("building the native kernels failed; using PyTorch kernels (slower):\n%s", exc.stderr)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("the native kernels are unavailable (%s); using PyTorch kernels (slower)", exc)
    return None
