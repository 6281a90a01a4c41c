"""The fast precision's decoder layers run as one native call (``bargein/kernels/fast_forward.c``).

In ``fast`` every operation of a layer is already a native kernel; called one by one from
Python, a decode step of a 30-layer model still spends milliseconds in some fifteen ctypes
calls, tensor allocations and module dispatches per layer. :class:`FusedLayers` describes
a stage's layers to the C side once, when the model is built (weights' blocks, norms,
biases, RoPE tables: pointers in ctypes structures), and each forward then makes a single
call that runs them all, with the first stage's embedding lookup and the last stage's
final norm and LM head, with the very
kernels the per-operation path calls, in the same order, so that the logits, hidden states
and K/V written are bit for bit the same (tests/kernels/test_fused_forward.py; the families'
features, tests/kernels/test_fused_families.py; mixtures of experts,
tests/kernels/test_fused_moe.py).

The caches are the caller's (the runner's); their pointers are written into the array
when a forward brings caches other than the last ones, and the array keeps those
:class:`KVCache` objects alive while it points at them. Calls are serialised by a lock,
since the structures carry each call's pointers.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import threading
from collections.abc import Sequence

import torch

from bargein.config import ModelConfig
from bargein.kernels.block_quant import BlockWeight
from bargein.kernels.native import NativeKernels
from bargein.kernels.native_structs import (
    FastEmbed,
    FastHead,
    FastLayer,
    FastShape,
    Q8Weight,
    describe_quant,
)
from bargein.kernels.quant_weight import QuantWeight
from bargein.model.attention import AttentionMetadata, KVCache
from bargein.model.moe import MoEFeedForward


class FusedLayers:
    """A range of decoder layers, ready for ``NativeKernels.fast_layers``. Build with :meth:`build`."""

    def __init__(self, native: NativeKernels, config: ModelConfig, layers: ctypes.Array[FastLayer],
                 rope: tuple[torch.Tensor, torch.Tensor], embed: FastEmbed | None, head: FastHead | None,
                 keep: list[object], local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 embed_scale: bool = False):
        self.native = native
        self.config = config
        self._layers = layers
        self._embed = embed
        self._head = head
        self.vocab_size = head.weight.n if head is not None else 0
        self._keep = [*keep, *rope, *(local_rope or ())]  # the tensors the structures point into
        self._caches: tuple[KVCache, ...] = ()
        # The structures hold per-call pointers (caches, ids, logits): one call at a time,
        # should two engines share this model (the kernels share one thread pool anyway).
        self._lock = threading.Lock()
        # The calls' buffers, kept from call to call and grown to the largest call's rows:
        # a prompt chunk's (tens of MB) allocated per call were mapped, faulted and zeroed anew
        # each time (22k page faults per 512-token chunk of a 1B model).
        self._workspace = torch.empty(0, dtype=torch.float32)
        self._workspace_rows = 0  # the rows it holds buffers for (it grows with them only)
        cos, sin = rope
        self._shape = FastShape(hidden=config.hidden_size, intermediate=config.intermediate_size, num_slots=0,
                                num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                                head_dim=config.head_dim, block_size=0, eps=config.rms_norm_eps,
                                scale=config.scale, cos_table=cos.data_ptr(), sin_table=sin.data_ptr(),
                                num_positions=cos.shape[0], softcap=config.attn_softcap or 0.0,
                                final_softcap=config.final_softcap or 0.0,
                                # the multiplier LlamaStage.forward applies, rounded to float32 alike
                                embed_scale=config.hidden_size ** 0.5 if embed_scale else 0.0,
                                gelu=config.activation == "gelu_tanh",
                                local_cos_table=local_rope[0].data_ptr() if local_rope else None,
                                local_sin_table=local_rope[1].data_ptr() if local_rope else None)

    @property
    def has_embed(self) -> bool:
        """Whether the call starts from token ids (looks up the embedding itself)."""
        return self._embed is not None

    @property
    def has_head(self) -> bool:
        """Whether the call ends with the final norm and LM head (returns logits)."""
        return self._head is not None

    @classmethod
    def build(cls, config: ModelConfig, blocks: Sequence[torch.nn.Module], rope: tuple[torch.Tensor, torch.Tensor],
              native: NativeKernels, embed: torch.nn.Module | None = None,
              head: tuple[torch.nn.Module, torch.nn.Module] | None = None,
              local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
              embed_scale: bool = False) -> FusedLayers | None:
        """The fused form of ``blocks`` (TransformerBlocks of a fast model), with ``rope``'s
        cos and sin tables (positions, head_dim) and the local layers' own (``local_rope``,
        Gemma 3; None: they use ``rope``), for the first stage its ``embed``
        (TokenEmbedding) and for the last ``head`` (the final RMSNorm and the LM head's
        Linear); ``embed_scale``: the stage's input is scaled by sqrt(hidden) (the first stage
        of a Gemma), whether or not the call looks the embedding up. None where a layer does
        not fit the C side's contract (a weight not held in blocks, a bias where the fused call
        takes none, a tensor not float32 and contiguous): then the model keeps running its
        layers one operation at a time. An embedding or head that does not fit is left to the
        caller (see ``has_embed``, ``has_head``)."""
        tables = [*rope, *(local_rope or ())]
        if not all(_float32(t) and t.shape == (rope[0].shape[0], config.head_dim) for t in tables):
            return None
        keep: list[object] = []
        array = (FastLayer * len(blocks))()
        for slot, block in zip(array, blocks, strict=True):
            attention, ffn = block.attention, block.feed_forward
            moe = None
            if isinstance(ffn, MoEFeedForward):  # its MLP is the experts' (w13, w2 unused)
                if (moe := ffn.fused_description(functools.partial(_weight, keep=keep))) is None:
                    return None
                keep += [moe, ffn]
            mlp = [ffn.w13, ffn.w2] if moe is None else []
            weights = [_weight(lin, keep) for lin in (attention.wqkv, attention.wo, *mlp)]
            norms = [block.attn_norm.weight, block.ffn_norm.weight]
            bias = attention.wqkv.bias
            c = config
            q_width, qkv_width = c.num_heads * c.head_dim, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
            shapes = [(qkv_width, c.hidden_size), (c.hidden_size, q_width), (2 * c.intermediate_size, c.hidden_size),
                      (c.hidden_size, c.intermediate_size)][:len(weights)]
            if any(w is None or (w.n, w.k) != shape for w, shape in zip(weights, shapes, strict=True)) \
                    or not all(_float32(t) for t in norms) \
                    or any(lin.bias is not None for lin in (attention.wo, *mlp)) \
                    or (bias is not None and not _float32(bias)):
                return None
            features = _feature_norms(block, config)
            if features is None:
                return None
            keep += [*norms, bias, *(t for t in features if t is not None)]
            slot.attn_norm, slot.ffn_norm = norms[0].data_ptr(), norms[1].data_ptr()
            slot.qkv_bias = bias.data_ptr() if bias is not None else None
            slot.wqkv, slot.wo = weights[:2]
            if moe is None:
                slot.w13, slot.w2 = weights[2:]
            else:
                slot.moe = ctypes.addressof(moe)
            slot.q_norm, slot.k_norm, slot.post_attn_norm, slot.post_ffn_norm = (
                t.data_ptr() if t is not None else None for t in features)
            slot.window = attention.window or 0
            slot.local = attention.is_local and local_rope is not None
        fused_head = None
        if head is not None:
            norm, lm_head = head
            weight = _weight(lm_head, keep) if lm_head.bias is None else None
            if weight is not None and weight.k == config.hidden_size and _float32(norm.weight):
                keep.append(norm.weight)
                fused_head = FastHead(norm=norm.weight.data_ptr(), weight=weight)
        fused_embed = None
        if embed is not None:
            table = embed.blocks if embed.blocks is not None else embed.weight
            quant = getattr(embed, "quant", None)  # a GGUF file's blocks (the loader's TokenEmbedding)
            if quant is not None:
                weight = _quant(quant, keep)
                if weight.k == config.hidden_size:
                    fused_embed = FastEmbed(blocks=weight, vocab=weight.n)
            elif isinstance(table, BlockWeight):
                weight = _q8(table, keep)
                if weight is not None and weight.k == config.hidden_size:
                    fused_embed = FastEmbed(blocks=weight, vocab=weight.n)
            elif _float32(table) and table.dim() == 2 and table.shape[1] == config.hidden_size:
                keep.append(table)
                fused_embed = FastEmbed(dense=table.data_ptr(), vocab=table.shape[0])
        return cls(native, config, array, rope, fused_embed, fused_head, keep, local_rope, embed_scale)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: Sequence[KVCache], logits_indices: torch.Tensor | None = None,
                 logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """For x token ids (T,) where the call has the embedding, else hidden states
        (T, hidden): float32 logits (N, vocab) of rows ``logits_indices`` (all rows if None)
        where the call has the head, else the hidden states after every layer (T, hidden).
        x itself is left as it was. ``logits_out``: where the head writes the logits (and
        the tensor returned) if it is a contiguous float32 CPU tensor of exactly (N, vocab);
        otherwise the logits go to a new tensor."""
        if meta.token_seq is None or meta.token_context is None:
            raise ValueError("the fast precision's attention needs AttentionMetadata.build's per-token fields")
        with self._lock:
            self._bind(kv_caches)
            if positions.dtype != torch.int64 or not positions.is_contiguous():
                positions = positions.to(torch.int64).contiguous()
            embed = self._embed
            if embed is not None:
                ids = x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()
                out = torch.empty((ids.shape[0], self.config.hidden_size), dtype=torch.float32)
                embed.ids = ids.data_ptr()
            else:
                out = x.clone(memory_format=torch.contiguous_format)
            head = self._head
            logits = None
            if head is not None:
                rows = logits_indices if logits_indices is not None else torch.arange(out.shape[0])
                if rows.dtype != torch.int64 or not rows.is_contiguous() or rows.dim() != 1:
                    rows = rows.to(torch.int64).contiguous().view(-1)
                shape = (rows.shape[0], self.vocab_size)
                logits = logits_out if logits_out is not None and logits_out.shape == shape \
                    and _float32(logits_out) else torch.empty(shape, dtype=torch.float32)
                head.rows, head.num_rows, head.logits = rows.data_ptr(), rows.shape[0], logits.data_ptr()
            if out.shape[0] > self._workspace_rows:  # a step's only extra work: a compare
                self._workspace = torch.empty(self.native.fast_workspace_floats(self._shape, out.shape[0]),
                                              dtype=torch.float32)
                self._workspace_rows = out.shape[0]
            self.native.fast_layers(self._layers, self._shape, out, positions, meta.slot_mapping, meta.block_tables,
                                    meta.token_seq, meta.token_context, embed, head, self._workspace,
                                    torch.get_num_threads())
        return out if logits is None else logits

    def _bind(self, kv_caches: Sequence[KVCache]) -> None:
        """Points the layers at these caches, unless they are the ones already bound."""
        if len(kv_caches) == len(self._caches) and all(map(operator.is_, kv_caches, self._caches)):
            return
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"{len(self._layers)} layers need as many caches; got {len(kv_caches)}")
        first = kv_caches[0].k
        c = self.config
        for cache in kv_caches:
            for tensor in (cache.k, cache.v):
                if tensor.dtype != torch.float16 or not tensor.is_contiguous() or tensor.device.type != "cpu" \
                        or tensor.shape != first.shape or tensor.shape[2:] != (c.num_kv_heads, c.head_dim):
                    raise ValueError("the fused fast forward needs contiguous float16 CPU caches of one shape "
                                     f"(blocks, block size, {c.num_kv_heads}, {c.head_dim})")
        for slot, cache in zip(self._layers, kv_caches, strict=True):
            slot.k_cache, slot.v_cache = cache.k.data_ptr(), cache.v.data_ptr()
        self._shape.num_slots = first.shape[0] * first.shape[1]
        self._shape.block_size = first.shape[1]
        self._caches = tuple(kv_caches)


def _feature_norms(block: torch.nn.Module, config: ModelConfig) -> list[torch.Tensor | None] | None:
    """The weights of a block's per-head Q/K norms (head_dim,) and post-norms (hidden,), each
    None where the block has none; None where one is not a float32 vector of its size."""
    attention = block.attention
    norms = [attention.q_norm, attention.k_norm, block.post_attn_norm, block.post_ffn_norm]
    sizes = [config.head_dim, config.head_dim, config.hidden_size, config.hidden_size]
    weights = [norm.weight if norm is not None else None for norm in norms]
    if any(w is not None and not (_float32(w) and w.shape == (size,)) for w, size in zip(weights, sizes, strict=True)):
        return None
    return weights


def _weight(linear: torch.nn.Module, keep: list[object]) -> Q8Weight | None:
    """How the fast forward reads this Linear's weight: its GGUF blocks (``quant``, which the
    per-operation path reads through KernelSet.quant_linear), else its BlockWeight if that
    is all it holds; None where it holds neither."""
    quant = getattr(linear, "quant", None)
    if quant is not None:
        return _quant(quant, keep)
    return _q8(linear.blocks, keep) if _blocks_only(linear) else None


def _quant(weight: QuantWeight, keep: list[object]) -> Q8Weight:
    matrix = describe_quant(weight)
    keep.append(matrix)
    n, k = weight.shape
    return Q8Weight(n=n, k=k, bits=0, quant=ctypes.addressof(matrix.struct))


def _blocks_only(linear: torch.nn.Module) -> bool:
    """Whether the fast forward of this Linear reads its blocks (and nothing else)."""
    return linear.blocks is not None and linear.weight is None and linear.packed is None


def _float32(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.is_contiguous() and tensor.device.type == "cpu"


def _q8(blocks: BlockWeight, keep: list[object]) -> Q8Weight | None:
    if not (blocks.qs.is_contiguous() and _float32(blocks.scales)
            and (blocks.mins is None or _float32(blocks.mins))):
        return None
    keep.append(blocks)
    n, k = blocks.shape
    return Q8Weight(qs=blocks.qs.data_ptr(), scales=blocks.scales.data_ptr(),
                    mins=blocks.mins.data_ptr() if blocks.mins is not None else None, n=n, k=k, bits=blocks.bits)
