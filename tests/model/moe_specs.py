"""The tiny random mixture-of-experts models, as transformers' own classes build them
(hidden 64, 2 layers, 4-8 experts); tests/model/make_moe_files.py writes them to
tests/data/moe/<name>/ in both formats. As for the dense families (family_specs.py), the
tests' reference is rebuilt from the committed folder, never from these specs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.model.family_specs import CHATML


@dataclass(frozen=True)
class MoESpec:
    """One MoE family's tiny model: ``name`` is its folder under tests/data/moe."""

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    chat_template: str = CHATML


_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
               max_position_embeddings=256, tie_word_embeddings=False)

MOE_FAMILIES: tuple[MoESpec, ...] = (
    # Softmax over all experts, top 2 of 8, the chosen weights renormalised (norm_topk_prob).
    MoESpec("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
            dict(_COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True, decoder_sparse_step=1, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Softmax, top 2 of 8, not renormalised; a shared expert behind a sigmoid gate; QKV bias.
    MoESpec("qwen2moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
            dict(_COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 shared_expert_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=1, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Top 2 of 4, softmax over the two chosen logits; its GGUF says architecture "llama".
    MoESpec("mixtral", "MixtralConfig", "MixtralForCausalLM",
            dict(_COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
)
