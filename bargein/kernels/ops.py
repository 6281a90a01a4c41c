"""The kernels one model runs on, chosen once: our native C kernels or PyTorch's own.

:func:`resolve_kernels` is the only place that may build the native library (it runs
the C compiler on a machine's first use); the engine calls it once, from its config,
and hands the :class:`KernelSet` to the model it builds. Model code never compiles or
loads anything: it asks the set for an operation, and the set picks the native path
where the tensors fit its contract (float32 on the CPU) and PyTorch's otherwise.

CUDA (or any device but the CPU) always gets PyTorch's paths: the native kernels are
CPU code.

Precision. ``exact`` computes in float32 from the stored weights, as the reference does.
``fast`` (CPU with native kernels only) quantizes activations to int8 per block of 32 for
the weights held in 4-/8-bit blocks (quant_matmul.c), multiplies float32 activations by
float-source weights held as 16-bit rows (half_matmul.c), keeps K/V in float16, and runs the
norms, the gated activation and attention through native row-wise kernels, so that a
token's result depends on nothing but its own row: not on how many rows share the
forward, nor on the thread count. Without the native kernels (no C compiler) or off the
CPU, ``fast`` runs as ``exact`` after one logged warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bargein.config import PRECISIONS
from bargein.kernels.block_quant import BlockWeight, recover_blocks
from bargein.kernels.native import NativeKernels, load_native_kernels
from bargein.kernels.native_structs import QuantMatrix, describe_quant
from bargein.kernels.quant_weight import QuantWeight

log = logging.getLogger(__name__)


# Forwards of at most this many rows read block-quantized weights through the native
# matmul; beyond it the packed float32 matmul wins (see bargein.model.linear).
BLOCK_KERNEL_MAX_ROWS = 12
# In ``exact``, forwards of at most this many rows multiply float32 activations by a file's
# blocks in C (gguf_matmul.c); beyond it, columns of W are widened a chunk at a time into
# a reused float32 buffer and multiplied by PyTorch's GEMM (no resident float32 copy).
QUANT_EXACT_MAX_ROWS = 8
QUANT_CHUNK_VALUES = 1 << 20  # values of W widened per chunk (4 MB of float32)


@dataclass(frozen=True)
class KernelSet:
    """Operations with a native and a PyTorch path. ``native`` is None for PyTorch only.

    ``fast`` is set only together with ``native`` (see :func:`resolve_kernels`).
    """

    native: NativeKernels | None = None
    fast: bool = False

    @property
    def precision(self) -> str:
        return "fast" if self.fast else "exact"

    def block_form(self, weight: torch.Tensor) -> BlockWeight | None:
        """The compact Q4/Q8 form of ``weight`` worth keeping for :meth:`block_linear`, or None:
        only a form that rebuilds the weight exactly (a float weight is never re-quantized;
        ``fast`` holds it as 16-bit rows, see :mod:`bargein.kernels.half_rows`)."""
        if self.native is None or weight.device.type != "cpu":
            return None
        return recover_blocks(weight)

    def block_linear(self, x: torch.Tensor, blocks: BlockWeight) -> torch.Tensor | None:
        """``x @ W.T`` from the block form, where the native kernel is the path to take; else None.

        ``fast``: always, with int8 activations. ``exact``: for at most
        :data:`BLOCK_KERNEL_MAX_ROWS` rows, where reading the compact weight wins.
        """
        if self.native is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
            return None
        if self.fast:
            return self.native.q8_block_matmul(x.contiguous(), blocks, torch.get_num_threads())
        if x.shape[0] > BLOCK_KERNEL_MAX_ROWS:
            return None
        return self.native.block_matmul(x.contiguous(), blocks, torch.get_num_threads())

    def quant_linear(self, x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
        """``x @ W.T`` for x (T, k) float32 and W held in a file's blocks, in this set's precision.

        ``fast``: activations quantized to int8 per block of 32 against each segment's
        blocks (row- and thread-invariant). ``exact``: float32 activations against the
        blocks' values: in C for few rows, else chunks of W widened into a reused float32
        buffer for PyTorch's GEMM. Without the native kernels (or off the CPU, or x not
        float32) this is the reference: the weight dequantized, then ``F.linear``.
        """
        if self.native is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 1:
            return F.linear(x, weight.dequantize().to(x.device, x.dtype))
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k).contiguous()
        matrix = describe_quant(weight)
        threads = torch.get_num_threads()
        if self.fast or rows.shape[0] <= QUANT_EXACT_MAX_ROWS:
            y = self.native.quant_matmul(rows, matrix, threads, exact=not self.fast)
        else:
            y = self._chunked_linear(rows, matrix, threads)
        return y.view(*lead, y.shape[-1])

    def _chunked_linear(self, x: torch.Tensor, matrix: QuantMatrix, threads: int) -> torch.Tensor:
        n, k = matrix.weight.shape
        chunk = max(16, min(n, QUANT_CHUNK_VALUES // max(k, 1)))
        y = torch.empty((x.shape[0], n), dtype=torch.float32)
        buffer = torch.empty((chunk, k), dtype=torch.float32)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            part = self.native.quant_rows(matrix, torch.arange(start, stop), threads, buffer[:stop - start])
            y[:, start:stop] = torch.mm(x, part.t())
        return y

    def quant_embedding(self, weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of an embedding table held in blocks, as float32 (len(ids), k): the
        values gguf.quants gives, in either precision."""
        if self.native is None:
            return weight.dequantize_rows(ids)
        return self.native.quant_rows(describe_quant(weight), ids, torch.get_num_threads())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """The row-wise native RMS norm in ``fast`` (float32 CPU rows); else None."""
        if not self.fast or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
            return None
        return self.native.rms_norm(x.contiguous(), weight, eps, torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of x = [gate | up] by the row-wise native kernel in ``fast``; else None."""
        if not self.fast or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.dim() != 2:
            return None
        return self.native.silu_mul(gate_up.contiguous(), torch.get_num_threads())

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``gelu_tanh(gate) * up`` (GeGLU) by the row-wise native kernel in ``fast``; else None."""
        if not self.fast or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.dim() != 2:
            return None
        return self.native.gelu_tanh_mul(gate_up.contiguous(), torch.get_num_threads())

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """``cap * tanh(x / cap)``: row-wise native in ``fast`` (float32 CPU rows), else PyTorch's."""
        if self.fast and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2:
            return self.native.softcap(x.contiguous(), cap, torch.get_num_threads())
        return torch.tanh(x / cap) * cap

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """The K/V cache's dtype this set asks for (float16 in ``fast``), or None: the model's."""
        return torch.float16 if self.fast else None

    def token_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        block_tables: torch.Tensor, token_seq: torch.Tensor,
                        token_context: torch.Tensor, *, window: int | None = None, softcap: float | None = None,
                        scale: float | None = None) -> torch.Tensor:
        """``fast``: RoPE on the fused qkv (T, (H + 2 KVH) D), K/V stored as float16, then every
        query on its own over its keys (attention_f16.c), the last ``window`` only where
        given, scores times ``scale`` (None: head_dim^-0.5) and soft-capped where given;
        returns (T, H, D)."""
        assert self.native is not None and self.fast
        threads = torch.get_num_threads()
        q = self.native.rope_store_f16(qkv.contiguous(), cos, sin, slot_mapping, k_cache, v_cache, num_heads, threads)
        return self.native.paged_attention_f16(q, k_cache, v_cache, block_tables, token_seq, token_context,
                                               scale if scale is not None else q.shape[-1] ** -0.5, threads,
                                               window=window, softcap=softcap)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
        """One query per sequence over its paged keys: q (B, H, D) -> (B, H, D).

        ``block_tables`` (B, W) names each sequence's blocks, padded with any valid id;
        ``mask`` (B, 1, 1, W * block_size) is 0 where a key is visible and -inf past
        ``context_lens``. The native kernel reads the blocks in place (float32 CPU
        caches); PyTorch gathers them and runs scaled_dot_product_attention.
        """
        if self.native is not None and k_cache.dtype == torch.float32 and k_cache.device.type == "cpu" \
                and q.dtype == torch.float32 and q.is_contiguous() and block_tables.is_contiguous():
            return self.native.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                      q.shape[-1] ** -0.5, torch.get_num_threads())
        return gathered_decode_attention(q, k_cache, v_cache, block_tables, mask)


def gathered_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PyTorch's path: gather each sequence's blocks, padded to the widest, then SDPA."""
    bd, num_heads, kvh, d = q.shape[0], q.shape[1], k_cache.shape[2], k_cache.shape[3]
    # index_select copies whole blocks; advanced indexing (cache.k[tables]) is ~25% slower on CPU.
    ids = block_tables.reshape(-1)
    keys = k_cache.index_select(0, ids).view(bd, -1, kvh, d).transpose(1, 2)  # (Bd, KVH, L, D)
    values = v_cache.index_select(0, ids).view(bd, -1, kvh, d).transpose(1, 2)
    # One query per head: the heads sharing a KV head become that head's query rows, all
    # under the same mask. Grouped attention then needs no repeated K/V and no enable_gqa
    # (whose repeat may synchronise with the device, which a CUDA graph capture forbids).
    grouped = q.view(bd, kvh, num_heads // kvh, d)  # (Bd, KVH, group, D): head h uses KV head h // group
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask.to(q.dtype))
    return out.reshape(bd, num_heads, d)


TORCH_KERNELS = KernelSet()


def resolve_kernels(device: torch.device | str, *, native: bool = True, precision: str = "exact",
                    dtype: torch.dtype = torch.float32) -> KernelSet:
    """The kernels for a model on ``device``: native ones on the CPU where asked for and
    available (built on first use, else None with one logged reason), PyTorch's elsewhere.

    ``precision="fast"`` needs the native kernels and a float32 model on the CPU; without
    them the set is ``exact``, with one warning saying why.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    on_cpu = torch.device(device).type == "cpu"
    kernels = KernelSet(load_native_kernels()) if native and on_cpu else TORCH_KERNELS
    if precision == "fast":
        why = ("the device is not the CPU" if not on_cpu else "native kernels are off" if not native
               else "the native kernels are unavailable (see above)" if kernels.native is None
               else f"the model's dtype is {str(dtype).removeprefix('torch.')}, not float32"
               if dtype != torch.float32 else None)
        if why is None:
            return KernelSet(kernels.native, fast=True)
        log.warning("precision 'fast' needs the native CPU kernels and a float32 model, but %s; running 'exact'", why)
    return kernels
