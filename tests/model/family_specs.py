"""The tiny random models of each supported family, as transformers' own classes build them.

Each spec is a transformers config (a few layers, hidden 64) plus a family-style chat
template. ``tests/model/make_family_files.py`` saves each model as a safetensors folder
and converts that folder with llama.cpp's own converter; the results live in
``tests/data/families/<name>/`` (committed: CI has no llama.cpp checkout). The reference
model of a test is rebuilt from the committed folder with transformers, never from these
specs, so the test compares against exactly the weights the files hold.

Windows (8 tokens) and LongRoPE's original context (64) are small, so that the tests'
prompts of a few dozen tokens reach past them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLIDING_WINDOW = 8
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's turn markup; this tiny vocabulary has no <start_of_turn>, so the ChatML markers
# stand in for them while the layout (a "model" role, no system turn) is Gemma's.
GEMMA_STYLE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<|im_start|>' + role + '\n' + m['content'] | trim + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>model\n' }}{% endif %}"
)
PHI_STYLE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '<|im_end|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_end|>' }}{% endif %}"
)


@dataclass(frozen=True)
class FamilySpec:
    """One family's tiny model: ``name`` is its folder under tests/data/families."""

    name: str
    config_class: str  # transformers' config class
    model_class: str  # transformers' model class
    config: dict[str, Any] = field(default_factory=dict)
    chat_template: str = CHATML
    window: int | None = None  # the sliding window, where local layers have one


_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=256, tie_word_embeddings=True)

FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
               dict(_COMMON, num_hidden_layers=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    FamilySpec("mistral", "MistralConfig", "MistralForCausalLM",
               dict(_COMMON, num_hidden_layers=2, tie_word_embeddings=False, sliding_window=SLIDING_WINDOW,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
               window=SLIDING_WINDOW),
    FamilySpec("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
               dict(_COMMON, num_hidden_layers=4, query_pre_attn_scalar=16, sliding_window=SLIDING_WINDOW,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    hidden_activation="gelu_pytorch_tanh",
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
               chat_template=GEMMA_STYLE, window=SLIDING_WINDOW),
    # Six layers: llama.cpp reads Gemma 3's layer kinds as five local ones, then a global one.
    FamilySpec("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_COMMON, num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=SLIDING_WINDOW,
                    hidden_activation="gelu_pytorch_tanh",
                    layer_types=["sliding_attention"] * 5 + ["full_attention"],
                    rope_parameters={
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}),
               chat_template=GEMMA_STYLE, window=SLIDING_WINDOW),
    # Phi-4-mini's shape of attention: fused QKV and gate-up, 3/4 of each head rotated, LongRoPE.
    FamilySpec("phi3", "Phi3Config", "Phi3ForCausalLM",
               dict(_COMMON, num_hidden_layers=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
                    pad_token_id=0, bos_token_id=0, eos_token_id=0, original_max_position_embeddings=64,
                    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                     "original_max_position_embeddings": 64,
                                     "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                     "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}),
               chat_template=PHI_STYLE),
)
