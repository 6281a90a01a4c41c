"""The model families bargein reads, and what each one's checkpoint says about its layers.

A family is named by its Hugging Face architecture (config.json) or its GGUF
``general.architecture``. This module turns either description into the feature fields of
:class:`~bargein.config.ModelConfig` (per-head Q/K norms, sandwich norms, GeGLU, soft caps,
sliding windows, partial rotary, RoPE scaling) and says where each canonical tensor is
stored: its name in each format, and, for a family that stores several canonical tensors
in one (Phi-3's fused QKV and gate-up), which of the stored rows it is.

Conventions normalised at load time, so the model has one of each:
- Gemma's RMS norms multiply by ``1 + w``; the HF folder stores w, llama.cpp's converter
  stores ``w + 1``: canonical norm weights are the multiplier (``1 + w``).
- Partial rotary: each head of Q and K is reordered (see bargein.model.rope).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from bargein.config import ROPE_SCALINGS, ModelConfig, MoEConfig, RopeScaling
from bargein.loader.errors import UnsupportedModelError

# HF architecture -> family
HF_FAMILIES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MinistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3", "Phi3ForCausalLM": "phi3",
    **{"Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe", "MixtralForCausalLM": "mixtral"},
}
# GGUF general.architecture -> family (Mistral's GGUFs are "llama")
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3",
                 "phi3": "phi3", **{"qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe"}}
GEMMA = ("gemma2", "gemma3")
# The feature fields of ModelConfig (what a family sets beyond the shape).
Features = dict[str, Any]

# per-layer canonical suffix -> (GGUF suffix, HF suffix), for every family; overrides below
BASE_LAYER = {
    "attn_norm.weight": ("attn_norm.weight", "input_layernorm.weight"),
    "wq.weight": ("attn_q.weight", "self_attn.q_proj.weight"),
    "wk.weight": ("attn_k.weight", "self_attn.k_proj.weight"),
    "wv.weight": ("attn_v.weight", "self_attn.v_proj.weight"),
    "wo.weight": ("attn_output.weight", "self_attn.o_proj.weight"),
    "ffn_norm.weight": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "w1.weight": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "w2.weight": ("ffn_down.weight", "mlp.down_proj.weight"),
    "w3.weight": ("ffn_up.weight", "mlp.up_proj.weight"),
}
QK_NORM = {
    "q_norm.weight": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "k_norm.weight": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
}
SANDWICH = {  # Gemma: the MLP's input norm is "pre_feedforward", "post_attention" is after attention
    "ffn_norm.weight": ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
    "post_attn_norm.weight": ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    "post_ffn_norm.weight": ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
}
FUSED = {  # Phi-3: Q, K, V in one stored matrix, gate and up in another
    "wq.weight": ("attn_qkv.weight", "self_attn.qkv_proj.weight"),
    "wk.weight": ("attn_qkv.weight", "self_attn.qkv_proj.weight"),
    "wv.weight": ("attn_qkv.weight", "self_attn.qkv_proj.weight"),
    "w1.weight": ("ffn_up.weight", "mlp.gate_up_proj.weight"),
    "w3.weight": ("ffn_up.weight", "mlp.gate_up_proj.weight"),
}


def layer_tensors(config: ModelConfig) -> dict[str, tuple[str, str]]:
    """Per-layer canonical suffix -> (GGUF suffix, HF suffix) for this config's family."""
    table = dict(BASE_LAYER)
    if config.qk_norm:
        table.update(QK_NORM)
    if config.sandwich_norms:
        table.update(SANDWICH)
    if config.family == "phi3":
        table.update(FUSED)
    return table


def stored_rows(config: ModelConfig, canon: str) -> torch.Tensor | None:
    """The rows of the stored tensor that canonical tensor ``canon`` is, in order (None: all,
    as stored): its share of a fused matrix, with each head of Q and K reordered for
    partial rotary (see bargein.model.rope)."""
    suffix = canon.split(".", 2)[-1] if canon.startswith("layers.") else canon
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    start = 0
    if config.family == "phi3" and suffix in FUSED:
        start = {"wq.weight": 0, "wk.weight": q, "wv.weight": q + kv, "w1.weight": 0, "w3.weight": inter}[suffix]
    rotated = config.rotary_dim is not None and config.rotary_dim < config.head_dim \
        and suffix in ("wq.weight", "wk.weight", "wq.bias", "wk.bias")
    if start == 0 and not rotated and not (config.family == "phi3" and suffix in FUSED):
        return None
    rows = {"wq": q, "wk": kv, "wv": kv, "w1": inter, "w3": inter}[suffix.split(".")[0]]
    order = torch.arange(rows)
    if rotated:
        heads = rows // config.head_dim
        order = (torch.arange(heads).unsqueeze(1) * config.head_dim
                 + partial_rotary_order(config.head_dim, config.rotary_dim)).reshape(-1)
    return order + start


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Dimension i of the reordered head is dimension ``order[i]`` of the stored one:
    [rotated first half, passed first half, rotated second half, passed second half]."""
    half_rot, half_pass = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(half_rot), rotary_dim + torch.arange(half_pass),
                      half_rot + torch.arange(half_rot), rotary_dim + half_pass + torch.arange(half_pass)])


def norm_offset(config: ModelConfig, kind: str, canon: str) -> float:
    """What to add to a stored norm weight to make it the multiplier: 1 for a Gemma HF folder."""
    return 1.0 if kind == "hf" and config.family in GEMMA and canon.endswith("norm.weight") else 0.0


# --- Hugging Face config.json -------------------------------------------------------------

GEMMA3_DEFAULTS = {  # transformers' Gemma3TextConfig defaults, which shipped configs rely on
    "vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
}


def hf_text_config(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The text model's config: Gemma 3 from 4B up nests it under ``text_config``."""
    if family == "gemma3":
        text = cfg.get("text_config", cfg)
        return {**GEMMA3_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    return cfg


def hf_features(family: str, cfg: dict[str, Any], path: Path) -> Features:
    """ModelConfig's feature fields (and RoPE) from a text config (see :func:`hf_text_config`)."""
    layers, head_dim = int(cfg["num_hidden_layers"]), int(cfg.get("head_dim") or cfg["hidden_size"] //
                                                             cfg["num_attention_heads"])
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    global_params = params.get("full_attention", params)
    out: Features = {"family": family, "rope_theta": float(global_params.get("rope_theta", cfg.get("rope_theta",
                                                                                                  10000.0))),
                     "rope_scaling": hf_rope_scaling(global_params, path,
                                                     int(cfg.get("max_position_embeddings", 4096)))}
    window = cfg.get("sliding_window")
    local = _hf_local_layers(family, cfg, layers) if window else ()
    if local:
        out.update(sliding_window=int(window), local_layers=local)
    if family in ("qwen3", "gemma3"):
        out["qk_norm"] = True
    if family in GEMMA:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(f"{path}: Gemma activation {act!r} is not supported (gelu_pytorch_tanh)")
        out.update(sandwich_norms=True, activation="gelu_tanh", embed_scale=True,
                   query_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                   attn_softcap=cfg.get("attn_logit_softcapping") or None,
                   final_softcap=cfg.get("final_logit_softcapping") or None)
    if family == "gemma3":
        local_params = params.get("sliding_attention", {})
        out["local_rope_theta"] = float(local_params.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    factor = float(global_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if factor != 1.0:
        out["rotary_dim"] = int(head_dim * factor)
    return out


def _hf_local_layers(family: str, cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    kinds = cfg.get("layer_types")
    if kinds is not None:
        return tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    if family in ("mistral", "phi3"):
        return tuple(range(layers))
    if family == "gemma2":
        return tuple(range(0, layers, 2))
    if family == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return tuple(i for i in range(layers) if (i + 1) % pattern)
    if cfg.get("use_sliding_window"):  # Qwen2/3: the layers from max_window_layers on
        return tuple(range(int(cfg.get("max_window_layers", layers)), layers))
    return ()


def hf_rope_scaling(params: dict[str, Any], path: Path, max_positions: int) -> RopeScaling | None:
    """A RopeScaling from rope_scaling / rope_parameters; None for plain RoPE; others refused.
    A missing original context is ``max_positions`` (as transformers reads it)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind not in ROPE_SCALINGS:
        raise UnsupportedModelError(
            f"{path}: RoPE scaling type {kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")
    original = int(params.get("original_max_position_embeddings") or max_positions)
    if kind == "longrope":
        return RopeScaling(float(params.get("factor") or 0.0), original_max_position_embeddings=original,
                           kind=kind, attention_factor=params.get("attention_factor"),
                           short_factor=tuple(map(float, params["short_factor"])),
                           long_factor=tuple(map(float, params["long_factor"])))
    if kind == "yarn":
        return RopeScaling(float(params["factor"]), original_max_position_embeddings=original, kind=kind,
                           beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                           attention_factor=params.get("attention_factor"))
    if kind == "linear":
        return RopeScaling(float(params["factor"]), kind=kind)
    return RopeScaling(float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                       original)


# --- Sliding windows a file does not carry -----------------------------------------------

# Model names (a GGUF's general.name or basename, or its file name) of families trained with
# a sliding window that llama.cpp's converter does not write: Mistral 7B v0.1 (4096 tokens;
# later Mistral 7B versions have none, and a name does not always tell them apart).
WINDOW_TRAINED = {"mistral": 4096}


def with_sliding_window(config: ModelConfig, window: int) -> ModelConfig:
    """``config`` with the user's sliding window (``--sliding-window``): 0 makes every layer
    attend to the whole context; N > 0 gives the model's local layers a window of N
    positions, and every layer where the file marks none local (a Mistral GGUF)."""
    if window < 0:
        raise ValueError(f"a sliding window is 0 (none) or a number of positions, got {window}")
    if window == 0:
        return dataclasses.replace(config, sliding_window=None, local_layers=())
    return dataclasses.replace(config, sliding_window=window,
                               local_layers=config.local_layers or tuple(range(config.num_layers)))


def missing_window_warning(config: ModelConfig, names: list[str], path: Path) -> str | None:
    """A warning where a GGUF named like a family trained with a sliding window (``names``:
    its general.name, basename, file name) carries none: it runs with global attention, as
    llama.cpp runs it, which differs from the trained model past the window."""
    if config.sliding_window or config.family != "llama":
        return None
    for family, window in WINDOW_TRAINED.items():
        if any(family in name.lower() for name in names if name):
            return (f"{path}: this {family.capitalize()} GGUF carries no sliding window (llama.cpp's converter "
                    f"does not write one), so every layer attends to the whole context, as llama.cpp runs it; "
                    f"if the model was trained with a window ({family.capitalize()} 7B v0.1: {window} tokens), "
                    f"pass --sliding-window {window} (0 silences this)")
    return None


# --- GGUF metadata --------------------------------------------------------------------------

def gguf_features(family: str, get: Any, tensors: Any, path: Path, layers: int, head_dim: int, hidden: int,
                  heads: int) -> Features:
    """The feature fields from GGUF metadata, read as llama.cpp reads them (``get(key,
    default)`` reads ``{arch}.key``; ``tensors(name)`` a small float tensor or None)."""
    out: Features = {"family": family}
    if family in ("qwen3", "gemma3"):
        out["qk_norm"] = True
    window = int(get("attention.sliding_window", 0) or 0)
    if family in GEMMA:
        # llama.cpp: the 27B models scale queries by hidden / heads, the others by head_dim.
        big = layers == (46 if family == "gemma2" else 62)
        out.update(sandwich_norms=True, activation="gelu_tanh", embed_scale=True,
                   query_scale=(hidden / heads if big else head_dim) ** -0.5,
                   attn_softcap=get("attn_logit_softcapping", None) or None,
                   final_softcap=get("final_logit_softcapping", None) or None)
        if family == "gemma2" and not window:
            window = 4096  # llama.cpp's default for Gemma 2
        if window:
            pattern = get("attention.sliding_window_pattern", 2 if family == "gemma2" else 6)
            if isinstance(pattern, list):
                local = tuple(i for i, is_local in enumerate(pattern) if is_local)
            else:
                local = tuple(i for i in range(layers) if int(pattern) == 0 or i % int(pattern) < int(pattern) - 1)
            out.update(sliding_window=window, local_layers=local)
            if family == "gemma3":
                out["local_rope_theta"] = float(get("rope.freq_base_swa", 10000.0))
    rope_dim = get("rope.dimension_count", None)
    if rope_dim is not None and int(rope_dim) != head_dim:
        if family != "phi3":
            raise UnsupportedModelError(f"{path}: partial rotary ({rope_dim} of {head_dim}) is not supported "
                                        f"for architecture {family!r}")
        out["rotary_dim"] = int(rope_dim)
    out["rope_scaling"] = _gguf_rope_scaling(get, tensors, path)
    return out


def _gguf_rope_scaling(get: Any, tensors: Any, path: Path) -> RopeScaling | None:
    kind = get("rope.scaling.type", "none") or "none"
    original = int(get("rope.scaling.original_context_length", 0) or 0)
    short, long = tensors("rope_factors_short.weight"), tensors("rope_factors_long.weight")
    if short is not None and long is not None:  # Phi-3's LongRoPE, stored as tensors
        return RopeScaling(0.0, original_max_position_embeddings=original, kind="longrope",
                           attention_factor=get("rope.scaling.attn_factor", None),
                           short_factor=tuple(short.tolist()), long_factor=tuple(long.tolist()))
    if tensors("rope_freqs.weight") is not None:
        return None  # Llama 3.1's scaling, stored as the rope_freqs tensor (see bargein.model.rope)
    if kind in ("none", ""):
        return None
    factor = float(get("rope.scaling.factor", 1.0))
    if kind == "linear":
        return RopeScaling(factor, kind="linear")
    if kind == "yarn":
        log_mul = get("rope.scaling.yarn_log_multiplier", None)
        attention = 0.1 * float(log_mul) * math.log(factor) + 1.0 if log_mul else None
        return RopeScaling(factor, original_max_position_embeddings=original, kind="yarn",
                           beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)), attention_factor=attention)
    raise UnsupportedModelError(
        f"{path}: RoPE scaling type {kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")


# --- mixtures of experts ----------------------------------------------------------------------
# A Mixtral GGUF says architecture "llama": llama.expert_count marks it (see gguf_moe).

# An MoE layer's canonical suffix -> (GGUF suffix, HF suffix); "{e}" is the expert's index. In a
# GGUF each of the experts' matrices is one stacked tensor (experts, rows, k): expert e is its
# slice e (see bargein.loader.names.expert_index).
MOE_LAYER = {
    "router.weight": ("ffn_gate_inp.weight", "mlp.gate.weight"),
    "experts.{e}.w1.weight": ("ffn_gate_exps.weight", "mlp.experts.{e}.gate_proj.weight"),
    "experts.{e}.w3.weight": ("ffn_up_exps.weight", "mlp.experts.{e}.up_proj.weight"),
    "experts.{e}.w2.weight": ("ffn_down_exps.weight", "mlp.experts.{e}.down_proj.weight"),
}
MIXTRAL_LAYER = {
    "router.weight": ("ffn_gate_inp.weight", "block_sparse_moe.gate.weight"),
    "experts.{e}.w1.weight": ("ffn_gate_exps.weight", "block_sparse_moe.experts.{e}.w1.weight"),
    "experts.{e}.w3.weight": ("ffn_up_exps.weight", "block_sparse_moe.experts.{e}.w3.weight"),
    "experts.{e}.w2.weight": ("ffn_down_exps.weight", "block_sparse_moe.experts.{e}.w2.weight"),
}
SHARED_EXPERT = {  # Qwen2-MoE
    "shared.w1.weight": ("ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight"),
    "shared.w3.weight": ("ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"),
    "shared.w2.weight": ("ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight"),
    "shared_gate.weight": ("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"),
}
DENSE_MLP = ("w1.weight", "w2.weight", "w3.weight")


def moe_layer_tensors(config: ModelConfig) -> dict[str, tuple[str, str]]:
    """An MoE layer's canonical suffix -> (GGUF suffix, HF suffix), one entry per expert's
    matrix ("{e}" filled in), in place of the dense MLP's (see :func:`layer_tensors`)."""
    assert config.moe is not None
    table = {k: v for k, v in layer_tensors(config).items() if k not in DENSE_MLP}
    experts = MIXTRAL_LAYER if config.family == "mixtral" else MOE_LAYER
    for canon, (gguf, hf) in experts.items():
        for e in range(config.moe.num_experts if "{e}" in canon else 1):
            table[canon.format(e=e)] = (gguf, hf.format(e=e))
    if config.moe.shared_expert_intermediate_size:
        table.update(SHARED_EXPERT)
    return table


def hf_moe(family: str, cfg: dict[str, Any]) -> Features:
    """The MoE fields (``moe``, and Qwen3-MoE's Q/K norm) of an MoE family's config.json;
    nothing for a dense family."""
    if family not in ("qwen3moe", "qwen2moe", "mixtral"):
        return {}
    layers = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step)
    moe = MoEConfig(num_experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                    expert_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                    norm_topk_prob=family == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                    dense_layers=dense)
    return {"moe": moe, **({"qk_norm": True} if family == "qwen3moe" else {})}


def gguf_moe(arch: str, get: Any, has_tensor: Any, layers: int, feed_forward: int) -> Features:
    """The MoE fields from GGUF metadata, as llama.cpp reads them: ``{arch}.expert_count``
    (``get(key, default)`` reads ``{arch}.key``) makes the file an MoE, whatever the
    architecture says (Mixtral's is "llama", which then names the family "mixtral"); a layer
    without a router tensor (``has_tensor(name)``) is dense. llama.cpp renormalises the
    chosen weights for Qwen3-MoE and Mixtral, not for Qwen2-MoE."""
    experts = int(get("expert_count", 0) or 0)
    if not experts:
        return {}
    family = "mixtral" if arch == "llama" else GGUF_FAMILIES.get(arch, arch)
    norm = get("expert_weights_norm", None)
    moe = MoEConfig(num_experts=experts, experts_per_token=int(get("expert_used_count", 2)),
                    expert_intermediate_size=int(get("expert_feed_forward_length", 0) or feed_forward),
                    norm_topk_prob=bool(norm) if norm is not None else family != "qwen2moe",
                    shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0) or 0),
                    dense_layers=tuple(i for i in range(layers) if not has_tensor(f"blk.{i}.ffn_gate_inp.weight")))
    return {"family": family, "moe": moe, **({"qk_norm": True} if family == "qwen3moe" else {})}
