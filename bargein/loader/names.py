"""Canonical weight names, and which of them a layer range [start, end) holds.

Each family's names in either format are in bargein.loader.families; a canonical tensor
that a family stores inside a fused one names that stored tensor (see ``stored_rows``)."""

from __future__ import annotations

from collections.abc import Container

from bargein.config import ModelConfig
from bargein.loader.families import layer_tensors, moe_layer_tensors

BIAS_TENSORS: dict[str, tuple[str, str]] = {
    "wq.bias": ("attn_q.bias", "self_attn.q_proj.bias"),
    "wk.bias": ("attn_k.bias", "self_attn.k_proj.bias"),
    "wv.bias": ("attn_v.bias", "self_attn.v_proj.bias"),
}
# global canonical name -> (GGUF name, HF name)
GLOBAL_TENSORS: dict[str, tuple[str, str]] = {
    "embed.weight": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm.weight": ("output_norm.weight", "model.norm.weight"),
    "lm_head.weight": ("output.weight", "lm_head.weight"),
}


def check_layer_range(config: ModelConfig, layer_range: tuple[int, int] | None) -> tuple[int, int]:
    """None -> all layers; otherwise validate 0 <= start < end <= num_layers."""
    if layer_range is None:
        return 0, config.num_layers
    start, end = layer_range
    if not 0 <= start < end <= config.num_layers:
        raise ValueError(
            f"layer_range {layer_range} is not within [0, {config.num_layers}) or is empty"
        )
    return start, end


def wanted_tensors(config: ModelConfig, start: int, end: int) -> dict[str, tuple[str, str]]:
    """Canonical name -> (GGUF name, HF name) for every tensor layers [start, end) need.

    The embedding goes to the first stage, and also to the last one when the head is tied
    to it; the final norm and an untied head go to the last stage.
    """
    wanted: dict[str, tuple[str, str]] = {}
    last = end == config.num_layers
    if start == 0 or (last and config.tie_word_embeddings):
        wanted["embed.weight"] = GLOBAL_TENSORS["embed.weight"]
    dense_layer = layer_tensors(config)
    moe_layer = moe_layer_tensors(config) if config.moe is not None else dense_layer
    for table in (dense_layer, moe_layer):
        if config.attention_bias:
            table.update(BIAS_TENSORS)
    for i in range(start, end):
        sparse = config.moe is not None and config.moe.is_sparse(i)
        for suffix, (gguf_suffix, hf_suffix) in (moe_layer if sparse else dense_layer).items():
            wanted[f"layers.{i}.{suffix}"] = (
                f"blk.{i}.{gguf_suffix}",
                f"model.layers.{i}.{hf_suffix}",
            )
    if last:
        wanted["norm.weight"] = GLOBAL_TENSORS["norm.weight"]
        if not config.tie_word_embeddings:
            wanted["lm_head.weight"] = GLOBAL_TENSORS["lm_head.weight"]
    return wanted


def expert_index(canon: str) -> int | None:
    """The expert a canonical MoE weight belongs to (``layers.{i}.experts.{e}.*``), else None:
    in a GGUF, its slice of the stacked tensor the table names."""
    parts = canon.split(".")
    return int(parts[3]) if len(parts) > 4 and parts[0] == "layers" and parts[2] == "experts" else None


def read_whole(config: ModelConfig, canon: str, *, blocks: bool, last: bool) -> bool:
    """Whether a load without ``blocks`` (which reads every weight) or the first forward after
    one with them (the weights read in place) reads all of canonical weight ``canon``: all
    but an MoE's experts (a token reads those it is routed to) and, with ``blocks``, the
    embedding unless it is also the head (``last``: the stage ends the model; a lookup reads
    a row per token)."""
    if expert_index(canon) is not None:
        return False
    return canon != "embed.weight" or not blocks or (config.tie_word_embeddings and last)


# A stacked expert tensor's name part -> the part of each expert's own tensor in older files
# (llama.cpp's LLM_TENSOR_FFN_*_EXP, "blk.%d.ffn_gate.%d": Mixtral GGUFs converted before 2024-04).
PER_EXPERT_GGUF = {"ffn_gate_exps": "ffn_gate", "ffn_up_exps": "ffn_up", "ffn_down_exps": "ffn_down"}


def gguf_location(tensors: Container[str], canon: str, gguf_name: str) -> tuple[str, int | None]:
    """Where a canonical weight lies in a GGUF holding ``tensors`` (``gguf_name`` as
    :func:`wanted_tensors` names it): (tensor name, expert index to slice it at, or None).

    An expert's matrix is its slice of the layer's stacked tensor (``blk.N.ffn_gate_exps``),
    or, in a file that has no stacked tensor but one tensor per expert
    (``blk.N.ffn_gate.E.weight``), that whole tensor. A missing tensor is named as stacked,
    for the loader to report."""
    e = expert_index(canon)
    if e is None or gguf_name in tensors:
        return gguf_name, e
    blk, layer, part, suffix = gguf_name.split(".")
    single = f"{blk}.{layer}.{PER_EXPERT_GGUF.get(part, part)}.{e}.{suffix}"
    return (single, None) if single in tensors else (gguf_name, e)


def expected_shape(config: ModelConfig, canon: str) -> tuple[int, ...] | None:
    """The torch shape a canonical tensor must have; None for ones without a fixed shape."""
    h, q, kv = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
    )
    suffix = canon.split(".", 2)[-1] if canon.startswith("layers.") else canon
    if config.moe is not None:  # experts.{e}.w1.weight -> expert.w1.weight
        suffix = "expert." + suffix.split(".", 2)[-1] if suffix.startswith("experts.") else suffix
        moe_inter, shared = config.moe.expert_intermediate_size, config.moe.shared_expert_intermediate_size
        moe_shapes = {"router.weight": (config.moe.num_experts, h), "expert.w1.weight": (moe_inter, h),
                      "expert.w3.weight": (moe_inter, h), "expert.w2.weight": (h, moe_inter),
                      "shared.w1.weight": (shared, h), "shared.w3.weight": (shared, h),
                      "shared.w2.weight": (h, shared), "shared_gate.weight": (1, h)}
        if suffix in moe_shapes:
            return moe_shapes[suffix]
    return {
        "embed.weight": (config.vocab_size, h),
        "lm_head.weight": (config.vocab_size, h),
        "norm.weight": (h,),
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "post_attn_norm.weight": (h,),
        "post_ffn_norm.weight": (h,),
        "q_norm.weight": (config.head_dim,),
        "k_norm.weight": (config.head_dim,),
        "wq.weight": (q, h),
        "wk.weight": (kv, h),
        "wv.weight": (kv, h),
        "wo.weight": (h, q),
        "wq.bias": (q,),
        "wk.bias": (kv,),
        "wv.bias": (kv,),
        "w1.weight": (config.intermediate_size, h),
        "w3.weight": (config.intermediate_size, h),
        "w2.weight": (h, config.intermediate_size),
    }.get(suffix)
