"""The C structures the native kernels take, mirrored in ctypes, and the description of a
:class:`~bargein.kernels.quant_weight.QuantWeight` to the C side (made once per weight and
kept on it). Each class names the C type it mirrors; the fields follow its order exactly.
"""

from __future__ import annotations

import ctypes

import torch

from bargein.kernels.quant_weight import QuantWeight

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class Q8Weight(ctypes.Structure):
    """A block-held weight as the int8 matmul reads it (fast_forward.c's bargein_q8_weight_t):
    a BlockWeight's arrays, or ``quant``, the address of a :class:`QuantMatrix`'s struct."""

    _fields_ = [("qs", _P), ("scales", _P), ("mins", _P), ("n", _I64), ("k", _I64), ("bits", _I64),
                ("quant", _P)]


class QuantSegmentC(ctypes.Structure):
    """One segment of a GGUF-block matrix as gguf_matmul.c reads it (bargein_qseg_t)."""

    _fields_ = [("type", _I64), ("data", _P), ("row_bytes", _I64), ("rows", _I64), ("order", _P)]


class QuantMatrixC(ctypes.Structure):
    """A GGUF-block matrix (bargein_qmat_t): its segments, stacked along rows, and its shape."""

    _fields_ = [("segs", ctypes.POINTER(QuantSegmentC)), ("num_segs", _I64), ("n", _I64), ("k", _I64)]


class QuantMatrix:
    """A :class:`QuantWeight` described to the C side once: the structures, and the tensors
    they point into kept alive with them. Build with :func:`describe_quant`."""

    def __init__(self, weight: QuantWeight):
        self.weight = weight
        n, k = weight.shape
        segments = (QuantSegmentC * len(weight.segments))()
        self._keep: list[torch.Tensor] = []
        for slot, segment in zip(segments, weight.segments, strict=True):
            data = segment.data
            if data.stride(1) != 1 or data.device.type != "cpu":
                raise NativeKernelError("a segment's blocks must be CPU bytes, contiguous along each row")
            order = segment.order
            if order is not None:
                order = order.contiguous()
                if order.numel() and not 0 <= int(order.min()) <= int(order.max()) < data.shape[0]:
                    raise NativeKernelError("a segment's row order names a row it does not store")
                self._keep.append(order)
            self._keep.append(data)
            slot.type, slot.data, slot.row_bytes = int(segment.qtype), data.data_ptr(), data.stride(0)
            slot.rows, slot.order = segment.rows, (order.data_ptr() if order is not None else None)
        self._segments = segments
        self.struct = QuantMatrixC(segs=segments, num_segs=len(segments), n=n, k=k)


def describe_quant(weight: QuantWeight) -> QuantMatrix:
    """The C description of ``weight``, made once and kept on the weight itself, so that it
    lives and dies with it (a model calls its matmuls with the same weights every step; a
    cache keyed elsewhere would keep every weight, and its mapped file, alive)."""
    matrix = weight.__dict__.get("_native_matrix")
    if matrix is None:
        matrix = QuantMatrix(weight)
        weight.__dict__["_native_matrix"] = matrix  # beside the frozen fields; not one of them
    return matrix


class FastMoE(ctypes.Structure):
    """A mixture-of-experts MLP of the fused fast forward (fast_forward.c's bargein_fast_moe_t):
    gate, up and down are arrays of ``experts`` QuantMatrixC addresses (an ExpertTable's)."""

    _fields_ = [("router", _P), ("experts", _I64), ("rows_w", _I64), ("topk", _I64), ("norm", _I64),
                ("inter", _I64), ("gate", _P), ("up", _P), ("down", _P), ("shared_w13", Q8Weight),
                ("shared_w2", Q8Weight)]


class FastLayer(ctypes.Structure):
    """One decoder layer of the fused fast forward (fast_forward.c's bargein_fast_layer_t);
    ``moe``: the address of its FastMoE, None where its MLP is dense."""

    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("qkv_bias", _P), ("wqkv", Q8Weight), ("wo", Q8Weight),
                ("w13", Q8Weight), ("w2", Q8Weight), ("k_cache", _P), ("v_cache", _P), ("q_norm", _P),
                ("k_norm", _P), ("post_attn_norm", _P), ("post_ffn_norm", _P), ("window", _I64), ("local", _I64),
                ("moe", _P)]


class FastShape(ctypes.Structure):
    """The shapes and RoPE tables the layers of a fused fast forward share (fast_forward.c's
    bargein_fast_shape_t)."""

    _fields_ = [("hidden", _I64), ("intermediate", _I64), ("num_slots", _I64), ("num_heads", _I64),
                ("num_kv_heads", _I64), ("head_dim", _I64), ("block_size", _I64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("cos_table", _P), ("sin_table", _P), ("num_positions", _I64),
                ("softcap", ctypes.c_float), ("final_softcap", ctypes.c_float), ("embed_scale", ctypes.c_float),
                ("gelu", _I64), ("local_cos_table", _P), ("local_sin_table", _P)]


class FastEmbed(ctypes.Structure):
    """The token embedding of a fused fast forward (fast_forward.c's bargein_fast_embed_t)."""

    _fields_ = [("dense", _P), ("blocks", Q8Weight), ("ids", _P), ("vocab", _I64)]


class FastHead(ctypes.Structure):
    """The final norm and LM head of a fused fast forward (fast_forward.c's bargein_fast_head_t)."""

    _fields_ = [("norm", _P), ("weight", Q8Weight), ("rows", _P), ("num_rows", _I64), ("logits", _P)]


class NativeKernelError(RuntimeError):
    """A native kernel was handed tensors outside its contract, or ran out of memory."""
