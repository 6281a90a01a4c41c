"""Paged attention over a block-structured KV cache, with explicit metadata.

The cache of one layer is a pair of tensors ``(num_blocks, block_size, num_kv_heads,
head_dim)``. A sequence's keys live in the blocks its block table names, in order; the
token at position p sits in slot ``block_table[p // block_size] * block_size + p %
block_size``. Everything a forward needs to find them is in :class:`AttentionMetadata`,
built by the runner from the scheduler's plan: there is no global context object.

Tokens of one forward are laid out sequence after sequence. Sequences whose step is a
single token (decodes) are attended in one batch through the model's
:class:`~bargein.kernels.ops.KernelSet`: by the native kernel straight from the cache
where it fits (float32 on the CPU), else by PyTorch over a padded gather of their
blocks (any device and dtype). Longer ones (prompt chunks) are attended one at a time, since
padding a 500-token chunk to the batch would waste more than the loop costs.

In the ``fast`` precision (float16 caches) every token, of a prompt chunk or a decode,
attends on its own through one native kernel, so that its result never depends on what
else shares the forward (see ``bargein/kernels/attention_f16.c``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bargein.kernels.ops import TORCH_KERNELS, KernelSet
from bargein.model import zeroed


@dataclass(frozen=True)
class KVCache:
    """One layer's keys and values, each (num_blocks, block_size, num_kv_heads, head_dim)."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls(zeroed.zeros(shape, dtype, device), zeroed.zeros(shape, dtype, device))

    def copy_block(self, src: int, dst: int) -> None:
        self.k[dst].copy_(self.k[src])
        self.v[dst].copy_(self.v[src])


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a forward reads and writes K/V.

    ``slot_mapping[t]`` is the cache slot token t's K/V is written to. Sequence i owns
    tokens ``query_starts[i] : query_starts[i] + query_lens[i]``, which are its positions
    ``context_lens[i] - query_lens[i] ... context_lens[i] - 1``; it attends to its first
    ``context_lens[i]`` positions, found through ``block_tables[i]`` (padded with block
    0, never read past ``context_lens[i]``).
    """

    slot_mapping: torch.Tensor  # (T,) int64
    block_tables: torch.Tensor  # (B, max_blocks) int64
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    # The decodes' batch (None when built without it: the fast precision never reads it).
    decode_token_index: torch.Tensor | None  # (Bd,) int64: the token index of each decode in the forward
    decode_block_tables: torch.Tensor | None  # (Bd, nb) int64: the decodes' blocks, padded with block 0
    decode_context_lens: torch.Tensor | None  # (Bd,) int64
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, nb * block_size) float: 0 where a key is visible, -inf past it
    block_size: int
    # Per token: its sequence (row of block_tables) and how many positions it sees (its
    # position + 1). Built by ``build``; the fast precision's attention reads them.
    token_seq: torch.Tensor | None = field(default=None)  # (T,) int64
    token_context: torch.Tensor | None = field(default=None)  # (T,) int64

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def query_starts(self) -> tuple[int, ...]:
        starts, total = [], 0
        for n in self.query_lens:
            starts.append(total)
            total += n
        return tuple(starts)

    @classmethod
    def build(cls, *, block_tables: list[list[int]], query_lens: list[int], context_lens: list[int],
              block_size: int, device: torch.device | str = "cpu", decode_batch: bool = True) -> AttentionMetadata:
        """Derives the slot mapping and decode grouping from per-sequence block tables.

        ``decode_batch=False`` leaves the decode fields None: the fast precision attends
        token by token from the per-token fields and never reads them, and on a decode
        step their tensors cost more than the rest of the metadata.
        """
        slots: list[int] = []
        token_seq: list[int] = []
        token_ctx: list[int] = []
        decode_index: list[int] = []
        decode_tables: list[list[int]] = []
        decode_ctx: list[int] = []
        start = 0
        for seq, (table, q_len, ctx) in enumerate(zip(block_tables, query_lens, context_lens, strict=True)):
            if not 1 <= q_len <= ctx <= len(table) * block_size:
                raise ValueError(f"a sequence of {ctx} tokens ({q_len} new) cannot use a table of "
                                 f"{len(table)} blocks of {block_size}")
            for pos in range(ctx - q_len, ctx):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            token_seq.extend([seq] * q_len)
            token_ctx.extend(range(ctx - q_len + 1, ctx + 1))
            if q_len == 1 and decode_batch:
                decode_index.append(start)
                decode_tables.append(table[: (ctx + block_size - 1) // block_size])
                decode_ctx.append(ctx)
            start += q_len
        width = max((len(t) for t in block_tables), default=0)
        decode_width = max((len(t) for t in decode_tables), default=0)
        # Every integer goes to the device in one tensor, of which the fields are views: a
        # decode step spends more on creating small tensors than on anything else here.
        flat = slots + token_seq + token_ctx + decode_index + decode_ctx
        for table in block_tables:
            flat += table
            flat += [0] * (width - len(table))
        for table in decode_tables:
            flat += table
            flat += [0] * (decode_width - len(table))
        t, b, bd = len(slots), len(block_tables), len(decode_index)
        parts = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True).split(
            [t, t, t, bd, bd, b * width, bd * decode_width])
        decode_ctx_t = parts[4]
        mask = None
        if decode_batch:
            # Decodes attend in one padded batch; the mask is the same for every layer, so it
            # is built once here (as a float mask, which the CPU attention kernel takes
            # without converting it per call).
            key_pos = torch.arange(decode_width * block_size, device=device)
            mask = torch.where(key_pos.unsqueeze(0) < decode_ctx_t.unsqueeze(1), 0.0, float("-inf"))[:, None, None, :]
        return cls(
            slot_mapping=parts[0],
            block_tables=parts[5].view(b, width),
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            decode_token_index=parts[3] if decode_batch else None,
            decode_block_tables=parts[6].view(bd, decode_width) if decode_batch else None,
            decode_context_lens=decode_ctx_t if decode_batch else None,
            decode_mask=mask,
            block_size=block_size,
            token_seq=parts[1],
            token_context=parts[2],
        )


def fast_paged_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, cache: KVCache,
                         meta: AttentionMetadata, kernels: KernelSet, *, window: int | None = None,
                         softcap: float | None = None, scale: float | None = None) -> torch.Tensor:
    """The fast precision's attention for the fused, not yet rotated qkv (T, (H + 2 KVH) D):
    rotates q and k, writes K/V (float16) and attends each token on its own; (T, H, D).
    ``window``, ``softcap``, ``scale``: as :func:`windowed_paged_attention`."""
    if meta.token_seq is None or meta.token_context is None:
        raise ValueError("the fast precision's attention needs AttentionMetadata.build's per-token fields")
    return kernels.token_attention(qkv, cos.view(qkv.shape[0], -1), sin.view(qkv.shape[0], -1), num_heads,
                                   cache.k, cache.v, meta.slot_mapping, meta.block_tables, meta.token_seq,
                                   meta.token_context, window=window, softcap=softcap, scale=scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, kernels: KernelSet = TORCH_KERNELS) -> torch.Tensor:
    """Writes k, v (T, KVH, D) into the cache, then attends q (T, H, D); returns (T, H, D).

    Decodes go through ``kernels`` (native or PyTorch: the same to float32 rounding).
    """
    if meta.decode_token_index is None:
        raise ValueError("this attention needs AttentionMetadata.build's decode batch (decode_batch=True)")
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    cache.k.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = k
    cache.v.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = v
    out = torch.empty_like(q)
    if meta.decode_token_index.numel():
        out[meta.decode_token_index] = kernels.decode_attention(
            q[meta.decode_token_index], cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens,
            meta.decode_mask)
    for i, (start, q_len, ctx) in enumerate(zip(meta.query_starts, meta.query_lens, meta.context_lens, strict=True)):
        if q_len > 1:
            out[start:start + q_len] = _chunk_attention(q[start:start + q_len], cache, meta.block_tables[i], ctx)
    return out


def _chunk_attention(q: torch.Tensor, cache: KVCache, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """A chunk of q_len queries at the end of a ctx-long sequence: q (q_len, H, D)."""
    q_len, block_size = q.shape[0], cache.k.shape[1]
    kvh, d = cache.k.shape[2], cache.k.shape[3]
    blocks = table[: (ctx + block_size - 1) // block_size]
    # 4-D (batch of one) inputs: with 3-D ones SDPA on CPU falls back to its math path
    # (bmm + softmax + mask checks), about 1.7x slower than the flash kernel here.
    keys = cache.k.index_select(0, blocks).view(-1, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)  # (1, KVH, ctx, D)
    values = cache.v.index_select(0, blocks).view(-1, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
    qt = q.transpose(0, 1).unsqueeze(0)  # (1, H, q_len, D)
    if q_len == ctx:
        out = F.scaled_dot_product_attention(qt, keys, values, is_causal=True, enable_gqa=True)
    else:
        # Query i sits at position ctx - q_len + i and sees keys up to and including it.
        key_pos = torch.arange(ctx, device=q.device)
        query_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # (q_len, ctx)
        out = F.scaled_dot_product_attention(qt, keys, values, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def windowed_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                             meta: AttentionMetadata, *, window: int | None, softcap: float | None,
                             scale: float) -> torch.Tensor:
    """:func:`paged_attention` for a layer with any of a sliding window, soft-capped scores or
    a scale of its own (Mistral, Gemma): q (T, H, D), k and v (T, KVH, D) -> (T, H, D).

    A query at position p attends to positions ``max(0, p - window + 1) .. p`` (all of
    0..p without a window), so it sees at most ``window`` keys, itself included; only the
    blocks holding those positions are read. Scores are ``s = (q . k) * scale``, then
    ``softcap * tanh(s / softcap)`` where soft-capped, as Gemma 2 computes them. Sequence by
    sequence, decodes included: this is the exact reference, in PyTorch.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    cache.k.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = k
    cache.v.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = v
    out = torch.empty_like(q)
    for i, (start, q_len, ctx) in enumerate(zip(meta.query_starts, meta.query_lens, meta.context_lens, strict=True)):
        out[start:start + q_len] = _window_attention(q[start:start + q_len], cache, meta.block_tables[i], ctx,
                                                     window, softcap, scale)
    return out


def _window_attention(q: torch.Tensor, cache: KVCache, table: torch.Tensor, ctx: int, window: int | None,
                      softcap: float | None, scale: float) -> torch.Tensor:
    """q_len queries at the end of a ctx-long sequence, over the keys their windows reach."""
    q_len, block_size = q.shape[0], cache.k.shape[1]
    kvh, d = cache.k.shape[2], cache.k.shape[3]
    first = max(0, ctx - q_len - window + 1) if window is not None else 0  # the first position any query sees
    first_block = first // block_size
    blocks = table[first_block: (ctx + block_size - 1) // block_size]
    offset = first_block * block_size  # the position of the first key read
    keys = cache.k.index_select(0, blocks).view(-1, kvh, d)[:ctx - offset].transpose(0, 1)  # (KVH, L, D)
    values = cache.v.index_select(0, blocks).view(-1, kvh, d)[:ctx - offset].transpose(0, 1)
    group = q.shape[1] // kvh
    key_pos = torch.arange(offset, ctx, device=q.device)
    query_pos = torch.arange(ctx - q_len, ctx, device=q.device)
    visible = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # (q_len, L)
    if window is not None:
        visible &= key_pos.unsqueeze(0) > query_pos.unsqueeze(1) - window
    qt = q.transpose(0, 1)  # (H, q_len, D)
    keys = keys.repeat_interleave(group, dim=0)  # (H, L, D)
    values = values.repeat_interleave(group, dim=0)
    if softcap is None:
        out = F.scaled_dot_product_attention(qt, keys, values, attn_mask=visible, scale=scale)
    else:
        scores = torch.matmul(qt, keys.transpose(1, 2)) * scale  # (H, q_len, L)
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), values)
    return out.transpose(0, 1)
