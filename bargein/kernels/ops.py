"""The kernels one model runs on, chosen once: our native C kernels or PyTorch's own.

:func:`resolve_kernels` is the only place that may build the native library (it runs
the C compiler on a machine's first use); the engine calls it once, from its config,
and hands the :class:`KernelSet` to the model it builds. Model code never compiles or
loads anything: it asks the set for an operation, and the set picks the native path
where the tensors fit its contract (float32 on the CPU) and PyTorch's otherwise.

CUDA (or any device but the CPU) always gets PyTorch's paths: the native kernels are
CPU code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bargein.kernels.block_quant import BlockWeight, recover_blocks
from bargein.kernels.native import NativeKernels, load_native_kernels

# Forwards of at most this many rows read block-quantized weights through the native
# matmul; beyond it the packed float32 matmul wins (see bargein.model.linear).
BLOCK_KERNEL_MAX_ROWS = 12


@dataclass(frozen=True)
class KernelSet:
    """Operations with a native and a PyTorch path. ``native`` is None for PyTorch only."""

    native: NativeKernels | None = None

    def block_form(self, weight: torch.Tensor) -> BlockWeight | None:
        """The compact Q4/Q8 form of ``weight`` worth keeping for :meth:`block_linear`, or None."""
        if self.native is None or weight.device.type != "cpu":
            return None
        return recover_blocks(weight)

    def block_linear(self, x: torch.Tensor, blocks: BlockWeight) -> torch.Tensor | None:
        """``x @ W.T`` from the block form, where the native kernel is the faster path; else None."""
        if self.native is None or x.shape[0] > BLOCK_KERNEL_MAX_ROWS or x.dtype != torch.float32 \
                or x.device.type != "cpu" or x.dim() != 2:
            return None
        return self.native.block_matmul(x.contiguous(), blocks, torch.get_num_threads())

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


def resolve_kernels(device: torch.device | str, *, native: bool = True) -> KernelSet:
    """The kernels for a model on ``device``: native ones on the CPU where asked for and
    available (built on first use, else None with one logged reason), PyTorch's elsewhere."""
    if not native or torch.device(device).type != "cpu":
        return TORCH_KERNELS
    return KernelSet(load_native_kernels())
